"""An OpenEnv environment defined by a user: guess a number (0-9) in a few tries. The reward
of a step is 1 for the right digit, else a little for a short reply; the episode ends on
the right digit or after 3 guesses."""

from typing import Any, Optional

from openenv.core.env_server import Action, Environment, Observation, State


class GuessAction(Action):
    message: str


class GuessObservation(Observation):
    prompt: str = ""


class GuessEnv(Environment):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self):
        super().__init__()
        self._state = State(episode_id=None, step_count=0)
        self.target = 0

    def reset(self, seed: Optional[int] = None, episode_id: Optional[str] = None, **kwargs: Any) -> GuessObservation:
        self.target = (seed or 0) % 10
        self._state = State(episode_id=episode_id, step_count=0)
        return GuessObservation(prompt="Guess my digit.", done=False, reward=None)

    def step(self, action: GuessAction, timeout_s: Optional[float] = None, **kwargs: Any) -> GuessObservation:
        self._state.step_count += 1
        text = action.message.strip()
        right = text[:1] == str(self.target)
        if text.startswith("RAISE"):
            raise RuntimeError("the environment broke")
        reward = 1.0 if right else 0.1 / (1 + len(text))
        done = right or self._state.step_count >= 3
        hint = "right" if right else ("higher" if not text[:1].isdigit() or int(text[:1]) < self.target else "lower")
        return GuessObservation(prompt=f"{hint}. Guess again.", done=done, reward=reward)

    @property
    def state(self) -> State:
        return self._state
