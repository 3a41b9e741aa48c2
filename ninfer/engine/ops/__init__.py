"""The ops interface: what a model's one forward is written against.

A backend implements every op below; model code (ninfer/engine/models/<arch>.py) never touches a
kernel, a cache tensor or a device. Before each forward the runner calls `ops.begin(ctx)` with its
step context (positions, block tables, caches, state slots); the ops that need it read it there.

Weights (at load, through models.weights.WeightReader, the one loader):
    linear_weight(items, bias, glu=False, logits=False)   fused rows of stored (format, parts) -> the backend's weight
                                    (glu: items are a gated MLP's [gate, up], for gated_linear only;
                                    the backend may keep the rows in its own order; logits: an
                                    untied lm_head, for logits only)
    embedding_weight(fmt, parts, lm_head)
    vector(t)                       a norm weight or conv taps, in the backend's dtype, on the device
    parameter(t)                    a small float32 tensor kept float32 (A_log, dt_bias)
Compute (x: [tokens, width] in the backend's compute dtype; `residual` is the backend's residual
stream, updated in place):
    embed(ids, w, scale=1) -> residual   rms_norm(x, w, eps) -> x   add_rms_norm(x, residual, w, eps) -> x
    linear(x, w) -> [T, N]
    linear_add_rms_norm(x, w, residual, norm, eps, then=None) -> add_rms_norm(linear(x, w), residual, norm, eps)
        then: the one weight whose linear / gated_linear consumes the result before `residual` is used
        again; a backend may leave the norm to that projection (cuda: its gemv's prologue)
    gated_linear(x, w, activation) -> [T, I]   act(x @ gate^T) * (x @ up^T), w a glu weight;
        activation "silu" (SwiGLU) or "gelu_tanh" (GeGLU); cuda decode: one gemv, the activation in its epilogue
    sigmoid_gate(x, gate) -> x * sigmoid(gate)
    attention(layer, qkv, q_norm, k_norm) -> [T, heads * head_dim]
        qkv: q | k | v heads side by side (a view of a fused projection); per-head RMSNorm
        (optional), the layer's RoPE over the first rotary dims, K/V stored in the layer's pages,
        causal paged attention within the layer's window (models.spec.attention_layers), scores
        scaled by query_pre_attn_scalar ** -0.5 (else head_dim) and soft-capped by
        attn_logit_softcapping when set; `layer` counts attention layers only
    short_conv(layer, x, weight) -> [T, C]
        causal depthwise conv + SiLU over each sequence's conv window, window updated
    gated_delta_rule(layer, q, k, v, a, b, A_log, dt_bias) -> [T, Hv, dv]
        the gated delta rule from each sequence's state (chunked scan for prompts, one step for
        decode rows), state updated; `layer` counts linear-attention layers only
    gated_rms_norm(x, z, w, eps) -> w * rmsnorm(x) * silu(z)     (x, z: [..., d], z may be a strided view)
    logits(x, w, out=None) -> [T, vocab] float32       soft_cap(x, cap) -> cap * tanh(x / cap), in place
"""
