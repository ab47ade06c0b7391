#!/usr/bin/env bash
# The tool-use demo: a tiny model learns, by RL through the OpenAI-compatible endpoint, to call
# a calculator tool instead of guessing products of 4-digit numbers.
#   bash ci/tool_demo.sh [key=value config overrides...]
DEMO=tool_use exec bash "$(dirname "$0")/demo.sh" "$@"
