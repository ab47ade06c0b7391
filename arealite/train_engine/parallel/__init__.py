"""How a train engine's ranks split the work: the layout (`layout`: every degree, its checks),
its meshes (`meshes`), and one module per kind of split: `sequence` (Ulysses), `tensor`
(DTensor projections), `experts` (expert parallelism), `moe_tokens` (a MoE block's tokens
split over the tensor-parallel ranks), `row_gather` (the rows a model-parallel
group computes together) and `grad_norm` (the gradient norm over every mesh)."""
