"""Low-precision formats the servers can generate with (FP8 today).

This package owns the wire format of quantised weights: how a bf16/fp32 weight becomes
the tensors an FP8 server loads, and back. It imports nothing but torch, so the trainer
(which quantises on the push), the embedded server (which serves the result) and tests
all share one definition.
"""
