"""Numerical kernels shared by the algorithms and the train engine; they import only torch.

`arealite.ops.fused_logprob` is the one chunked log-prob/entropy kernel: the train engine runs it
on the last hidden states and the output head (the ``[T, V]`` logits never exist), and
`arealite.algo.logprob`'s functions run it on logits a caller already holds.
"""
