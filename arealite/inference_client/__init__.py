"""The inference client: generation over HTTP against SGLang-compatible servers (retries,
failover, routing, batching of a group's samples, interruptible generation), the wire
formats, and the servers' administration routes a weight update uses
(`arealite.api.contracts.InferenceClient`, `WeightUpdateAdmin`). It only generates."""
