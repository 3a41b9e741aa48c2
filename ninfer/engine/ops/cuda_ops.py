"""The cuda implementation of the ops interface: ninfer's NVRTC kernels (kernels/launchers.py,
kernels/gdn.py), cuBLAS through torch.mm for prompt-sized matmuls.

Two routes, chosen by the step context, not by row count:
- decode (one new token per sequence, at most 8 rows, replayed from a CUDA graph): gemv over the
  stored weight format (llama.cpp block formats read in place by kernels/blocks.cu: on tensor
  cores with bf16 activations, route "blocks_tile" for blocks.TILE_FORMATS (q2_k / q3_k, and q5_0 /
  iq4_nl at K not in 64s: "blocks_mma"), else "blocks"), split-K paged decode attention (on tensor
  cores, attention_decode_mma.cu, where the profile's decode_attention route takes the layer),
  one delta-rule step per sequence. Fewer launches per layer: a gated MLP's activation runs in the
  gate_up gemv's epilogue (gated_linear over a glu weight, on the routes whose epilogue is
  common.cuh's tile_epilogue), and RoPE + the K/V write run inside the decode attention kernel
  (rope_attention_decode: act caches, whole-head rotary, no q/k norms, not verification), each with
  the bits of the kernels it replaces.
- prompt (prefill, chunks, prefix-hit suffixes): torch.mm on dense weights (quantized weights
  expanded per projection on the fly; block formats by the dequant_blocks kernel) over whole blocks
  of prompt_rows rows (padded): one call per up to PROMPT_CALL_ROWS rows where cuBLAS, kept from
  split-K (no_split_k), was found to give a row the bits of its lone block at every block count up
  to that (calls_keep_rows, once per weight shape), else one call per block; paged prefill
  attention, the delta rule over each sequence's tokens.
A fused projection whose parts differ in format (a Q4_K_M file's q/k in q4_k and v in q6_k) keeps
each run of one format as it is, as segments of one weight.
Every kernel computes a row from that row alone and cuBLAS gives a row its lone block's bits, so
a row's bits do not depend on the other rows of its batch or on where a prefix hit starts. The
device profile (kernels/profile.py) fixes the decode route per weight format, the attention
partition and decode route, and prompt_rows for the whole run (its defaults: DEFAULT_GEMV_ROUTES,
64 keys, mma, 128 rows).

Speculative verification runs on the decode route too: a verify row of width W (its last token and
W - 1 drafts) is W decode rows, sequence-major, each query attending over its own context; the
gated delta rule and the short conv step one position of every sequence at a time and keep the
state after each row (CudaContext.verify_*), from which the runner restores a rejected tail.

Activations, the KV cache, norm weights and conv windows are bf16, or fp32 with dtype=float32 (the
faithful mode); delta-rule states and the gate parameters are fp32. Outputs are allocated with
torch, so under graph capture they come from the graph's pool and stay put across replays.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ninfer.engine.config import ModelConfig
from ninfer.engine.models.spec import attention_layers
from ninfer.engine.ops.torch_ops import rotary_dim
from ninfer.engine.quant import TensorFormat, dequantize
from ninfer.engine.rope import Rope
from ninfer.formats import BLOCK_FORMATS
from ninfer.kernels import blocks as B
from ninfer.kernels import gdn as G
from ninfer.kernels import launchers as L
from ninfer.kernels.compiler import KernelCompiler
from ninfer.kernels.profile import CUBLAS, DeviceProfile

DTYPES = {torch.bfloat16: TensorFormat("bf16"), torch.float32: TensorFormat("f32")}  # activation dtypes
BLOCK_ROUTES = {"blocks": "warp", "blocks_mma": "mma", "blocks_tile": "tile"}  # Weight.route -> blocks.py's


@dataclass(slots=True)
class Weight:
    """A linear weight [N, K] as quant.py stores it (parts '', '.scales', '.mins'); fused
    projections are their row blocks concatenated, which holds for the quantized parts too."""

    fmt: TensorFormat
    parts: dict[str, torch.Tensor]
    bias: torch.Tensor | None = None  # [N], activation dtype
    route: str = "warp"  # the decode gemv kernel (launchers.GEMV_ROUTES; blocks.cu's: BLOCK_ROUTES)
    segments: list[Weight] | None = None  # row blocks in their own formats (then fmt/parts unused)
    glu: bool = False  # a gated MLP's gate and up rows in launchers.glu_rows' order (see gated_linear)
    prompt_copy: torch.Tensor | None = None  # [N, K] in the activation dtype, kept for prompt matmuls (see dense)

    @property
    def rows(self) -> int:
        return sum(s.rows for s in self.segments) if self.segments else self.parts[""].shape[0]


def gemv_ok(fmt: TensorFormat, k: int) -> bool:
    """Whether the gemv kernel takes this format at input width k (launchers.gemv's checks)."""
    return L.gemv_route_ok("warp", fmt, k, torch.float32)


def blocks_ok(fmt: TensorFormat, k: int) -> bool:
    """Whether blocks.cu reads this format at input width k."""
    return fmt.format in B.BLOCK_CODES and k % fmt.group_size == 0


def in_features(fmt: TensorFormat, part: torch.Tensor) -> int:
    """K of a stored weight's main part."""
    if fmt.blocks:
        elements, nbytes = BLOCK_FORMATS[fmt.format]
        return part.shape[1] // nbytes * elements
    return part.shape[1] * (2 if fmt.format == "int4" else 1)


@dataclass(slots=True)
class CudaContext:
    """One forward's inputs on the device (int32 unless said)."""

    decode: bool  # the decode route (see the module docstring)
    positions: torch.Tensor  # [T]
    kv_slots: torch.Tensor  # [T]: page * page_size + pos % page_size
    k_cache: list[torch.Tensor]  # per attention layer [pages, page_size, kv_heads, head_dim]
    v_cache: list[torch.Tensor]
    block_tables: torch.Tensor  # [B, max_pages]
    seq_lens: torch.Tensor  # decode: context_lens [B] (this token included); prompt: start_pos [B]
    max_context: int  # host bound on a sequence's context (decode: parts * the attention partition)
    cu_seqlens: torch.Tensor  # [B + 1]: sequence b's rows
    conv: list[torch.Tensor]  # per linear-attention layer [slots, conv_dim, conv_kernel - 1]
    ssm: list[torch.Tensor]  # per linear-attention layer [slots, value_heads, key_dim, value_dim] fp32
    state_slots: torch.Tensor | None  # [B]
    workspace: tuple[torch.Tensor, torch.Tensor] | None = None  # decode split-K scratch
    # speculative verification on the decode route: every sequence has verify_width rows
    # (sequence-major); cu_seqlens / state_slots then describe the B = T / verify_width sequences
    # with one row each, and verify_conv / verify_ssm (per linear-attention layer, indexed by row)
    # receive the recurrent state after each row
    verify_width: int = 0
    verify_conv: list[torch.Tensor] | None = None
    verify_ssm: list[torch.Tensor] | None = None
    # --kv-dtype int8|fp8: per attention layer f16 scales [pages, page_size, kv_heads] beside the
    # int8 / e4m3 caches; empty for a bf16 (or fp32) cache
    k_scale: list[torch.Tensor] = field(default_factory=list)
    v_scale: list[torch.Tensor] = field(default_factory=list)


# the most rows one prompt matmul call takes (calls_keep_rows checks each count up to it): the
# default prefill chunk, which one call then takes whole
PROMPT_CALL_ROWS = 1024


@dataclass(slots=True)
class Deferred:
    """A residual norm left to the prologue of its consumer's gemv (CudaOps.PRE_NORM): y, the residual
    gemv's output, is not yet added into `residual`, and only `then` may take y as its input (the gemv
    then forms rmsnorm(residual + y) * norm itself). The next residual gemv on `residual` adds y in its
    epilogue; anything else runs the norm on its own first (CudaOps._settle).
    With `parts` (CudaOps.SPLIT_NORM): y is h * norm, h = residual + the gemv's output already added into
    `residual`, and parts the sums of squares of h's 16-column pieces; `then`'s gemv scales its sums by
    the norm's rinv (launchers.gemv's hwout and rscale)."""
    y: torch.Tensor
    then: Weight
    residual: torch.Tensor
    norm: torch.Tensor
    eps: float
    parts: torch.Tensor | None = None


class CudaOps:
    """The ops interface on one CUDA device (see ninfer/engine/ops/__init__.py)."""

    def __init__(self, kc: KernelCompiler, config: ModelConfig, dtype: torch.dtype, device: torch.device,
                 profile: DeviceProfile | None = None) -> None:
        self.kc = kc
        self.profile = profile if profile is not None else DeviceProfile()
        self.config = config
        self.dtype = dtype
        self.device = device
        self.scale = (config.query_pre_attn_scalar or config.head_dim) ** -0.5
        self.rotary_dim = rotary_dim(config)
        # per attention layer: its window and its RoPE tables [max_positions, rotary_dim / 2] fp32
        # (scaled frequencies, interpolated positions and the attention factor folded in)
        self.layers = attention_layers(config)
        ropes = list(dict.fromkeys(a.rope for a in self.layers))
        tables = [rope_tables(r, config.max_position_embeddings, device) for r in ropes]
        self.layer_rope = [tables[ropes.index(a.rope)] for a in self.layers]
        self.ctx: CudaContext | None = None
        self._deferred: Deferred | None = None
        # tensor cores for prompt attention where they take it (one route for the whole run; layers
        # with a window or soft-capping take the warp kernel, which has them)
        self.prefill_attention = "mma" if L.attention_prefill_route_ok("mma", dtype, config.head_dim) else "warp"
        # the fused residual norm's arrival counter (launchers.norm_epilogue): zero between launches
        self.norm_counter = torch.zeros(1, dtype=torch.int32, device=device)
        self._decode_routes: dict[tuple[int, bool], str] = {}  # (page size, compressed) -> _decode_route's answer
        no_split_k()  # from the start, so every cuBLAS call of the run (graphs captured too) sees one setting
        self.call_rows: dict[tuple[int, int], int] = {}  # (K, N) -> prompt_call_rows, once per weight shape
        self.copies_bytes = 0  # prompt copies kept (PROMPT_COPY_BYTES)
        self.expands = False  # a projection's prompt matmul expands its weight per chunk (no copy kept)

    def begin(self, ctx: CudaContext) -> None:
        self.ctx = ctx
        self._deferred = None  # a residual norm left to its consumer's prologue (linear_add_rms_norm's `then`)

    # -- weights ----------------------------------------------------------------------------

    # Prompt matmuls multiply by a copy of a quantized weight in the activation dtype, expanded per
    # prompt chunk; for a small model that is a launch per projection and chunk whose host time the
    # matmuls do not hide (SmolLM2-135M int4: pp512 at ~1/3 of bf16's rate). The first
    # PROMPT_COPY_BYTES of copies a model's projections need are kept from the load instead (not an
    # lm_head's: logits are a gemv; none where there are no kernels, weights built on CPU for a test).
    PROMPT_COPY_BYTES = 512 << 20

    def linear_weight(self, items: list[tuple[TensorFormat, dict[str, torch.Tensor]]],
                      bias: torch.Tensor | None = None, glu: bool = False, logits: bool = False) -> Weight:
        w = self._linear_weight(items, bias, glu)
        size = self._copy_bytes(w) if not logits else 0
        if size and self.kc is not None and self.copies_bytes + size <= self.PROMPT_COPY_BYTES:
            w.prompt_copy = self.dense(w)
            self.copies_bytes += size
        elif size:
            self.expands = True
        return w

    def _linear_weight(self, items: list[tuple[TensorFormat, dict[str, torch.Tensor]]],
                       bias: torch.Tensor | None = None, glu: bool = False) -> Weight:
        if glu and self._glu_ok(items, bias):  # rows interleaved for the fused epilogue (gated_linear)
            (fmt, gate), (_, up) = items
            w = self._linear_weight([(fmt, {sfx: L.glu_rows(gate[sfx], up[sfx]) for sfx in gate})])
            w.glu = True
            return w
        fmts = [fmt for fmt, _ in items]
        first_fmt, first = items[0]
        k = in_features(first_fmt, first[""])
        b = bias.to(self.device, self.dtype).contiguous() if bias is not None else None
        if all(f == first_fmt for f in fmts) and blocks_ok(first_fmt, k):  # kept as stored
            return Weight(first_fmt, {"": torch.cat([parts[""] for _, parts in items]).contiguous()}, b,
                          self.blocks_route(first_fmt, k))
        if any(f.blocks for f in fmts) and all(blocks_ok(f, k) or gemv_ok(f, k) for f in fmts):
            # mixed formats around a block format: each run of one format kept as it is, one gemv per run
            runs: list[list[tuple[TensorFormat, dict[str, torch.Tensor]]]] = []
            for item in items:
                if runs and runs[-1][-1][0] == item[0]:
                    runs[-1].append(item)
                else:
                    runs.append([item])
            return Weight(DTYPES[self.dtype], {}, b, segments=[self._linear_weight(run) for run in runs])
        if all(f == first_fmt for f in fmts) and gemv_ok(first_fmt, k) and (
                first_fmt.quantized or first_fmt.format == "bf16"):  # bf16 is exact in either dtype
            route = self.gemv_route(first_fmt, k, sum(parts[""].shape[0] for _, parts in items))
            parts = {sfx: torch.cat([parts[sfx] for _, parts in items]).contiguous() for sfx in first}
            return Weight(first_fmt, L.gemv_pack(route, first_fmt, parts), b, route)
        # f32/f16, mixed formats or shapes the gemv kernel does not take: the activation dtype
        return Weight(DTYPES[self.dtype],
                      {"": torch.cat([dequantize(f, p, self.dtype) for f, p in items]).contiguous()}, b)

    def _glu_ok(self, items: list[tuple[TensorFormat, dict[str, torch.Tensor]]], bias: torch.Tensor | None) -> bool:
        """Whether a gated MLP's [gate, up] (no bias) is kept for the fused gemv epilogue: one format,
        rows in 8s, and a decode route whose epilogue takes it (launchers/blocks GLU_ROUTES)."""
        if len(items) != 2 or bias is not None or items[0][0] != items[1][0]:
            return False
        fmt, parts = items[0]
        rows, k = parts[""].shape[0], in_features(fmt, parts[""])
        if rows % 8 or items[1][1][""].shape != parts[""].shape:
            return False
        if fmt.blocks:
            return blocks_ok(fmt, k) and BLOCK_ROUTES[self.blocks_route(fmt, k)] in B.GLU_ROUTES
        return (gemv_ok(fmt, k) and (fmt.quantized or fmt.format == "bf16")
                and self.gemv_route(fmt, k, 2 * rows) in L.GLU_ROUTES)

    def blocks_route(self, fmt: TensorFormat, k: int) -> str:
        """blocks.cu's decode gemv at input width k: on tensor cores with bf16 activations (whole blocks
        per lane where the tile kernel takes the format and width), fp32 math otherwise."""
        if B.route_ok("tile", fmt, self.dtype, k):
            return "blocks_tile"
        return "blocks_mma" if self.dtype == torch.bfloat16 else "blocks"

    def gemv_route(self, fmt: TensorFormat, k: int, n: int | None = None) -> str:
        """The decode route for weights of `fmt`, input width k and n outputs (one route per weight,
        never per batch: rows must not depend on their batch): the profile's route for the format where
        it takes them (cublas: unquantized weights in the activation dtype), else, for int4, the mma route
        where a tiled route does not take them (N not in 16s, K not in 64s), else warp (int8's mma
        route is slower than warp at one row)."""
        route = self.profile.gemv_route(fmt)
        if route == CUBLAS:
            return route if fmt == DTYPES[self.dtype] else "warp"
        for r in (route, "mma") if route == "tiled" and fmt.format == "int4" else (route,):
            if L.gemv_route_ok(r, fmt, k, self.dtype, n):
                return r
        return "warp"

    def embedding_weight(self, fmt: TensorFormat, parts: dict[str, torch.Tensor], lm_head: bool) -> Weight:
        H = self.config.hidden_size
        if blocks_ok(fmt, H):  # gathered by dequant_blocks
            return Weight(fmt, {"": parts[""].contiguous()}, route=self.blocks_route(fmt, H))
        if fmt.quantized and H % fmt.group_size == 0 and fmt.group_size % 8 == 0 and gemv_ok(fmt, H):
            return Weight(fmt, dict(parts))  # the embedding kernel reads quant.py's layout: the warp route
        # the embedding kernel copies rows of the activation dtype
        w = dequantize(fmt, parts, self.dtype).contiguous()
        return Weight(DTYPES[self.dtype], {"": w}, route=self.gemv_route(DTYPES[self.dtype], H, w.shape[0]))

    def vector(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(device=self.device, dtype=self.dtype).contiguous()

    def parameter(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(device=self.device, dtype=torch.float32).contiguous()

    # -- compute ----------------------------------------------------------------------------

    def _empty(self, *shape: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype or self.dtype, device=self.device)

    def embed(self, ids: torch.Tensor, w: Weight, scale: float = 1.0) -> torch.Tensor:
        out = self._empty(ids.shape[0], self.config.hidden_size)
        if w.fmt.blocks:
            B.dequant_blocks(self.kc, w.fmt, w.parts[""], out, rows=ids)
        elif w.fmt.quantized:
            L.embedding_quant(self.kc, ids, w.fmt, w.parts, out)
        else:
            L.embedding(self.kc, ids, w.parts[""], out)
        return out.mul_(scale) if scale != 1.0 else out

    def rms_norm(self, x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        out = torch.empty_like(x)
        L.rmsnorm_residual(self.kc, x, w, out, eps)
        return out

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        out = torch.empty_like(x)
        L.rmsnorm_residual(self.kc, x, w, out, eps, residual=residual)
        return out

    # linear_add_rms_norm's one-launch form (the residual norm in the gemv's epilogue, by the block that
    # finishes last) is off: measured on the H100, the separate rmsnorm_residual launch, overlapped by
    # PDL, costs less than that block's serial tail (llama-8b int4 tg128 410.7 -> 420.3 unfused, bf16
    # 165.3 -> 172.7, SmolLM2 int4 1,822 -> 2,057; docs/PERF.md, session 21). Kept, with its tests
    # (tests/gpu/test_fused_norm.py), until an H200 run says whether it pays anywhere.
    FUSE_NORM = False

    # A decode row's residual norm in the prologue of the gemv that consumes it (linear_add_rms_norm's
    # `then`): the gemv's blocks each form the normed row in shared memory from the residual gemv's output
    # and the residual (common.cuh GEMV_PNORM), one launch fewer per norm; the residual, left one add
    # behind, is caught up by the next residual gemv's epilogue (common.cuh GEMV_CATCHUP). The same bits as
    # the separate rmsnorm_residual launch. bf16 activations, one row; bf16's mma pipeline, and the tiled
    # route only for a weight of at most PRE_NORM_SMALL bytes (a launch-bound gemv): every block forms
    # the whole row, which beside a tiled block's 16 quantized rows costs more than the launch saved,
    # where bf16's 16 rows are 2-3x the bytes. H100 tg128 (docs/PERF.md, session 29): llama-8b bf16
    # 177.3 -> 180.3, llama-1b bf16 867 -> 889, SmolLM2 int4 2,192 -> 2,309; llama-8b int4 with its
    # gate_up taking it 440.7 -> 406.9, llama-1b int4 1,554 -> 1,480.
    PRE_NORM = True
    PRE_NORM_SMALL = 2 << 20
    # A residual norm between two tiled gemvs split between them (launchers.gemv's hwout and rscale): the
    # residual gemv adds its output into the residual and writes h * norm and the sums of squares of h's
    # 16-column pieces in its epilogue; the consumer (linear_add_rms_norm's `then`) takes h * norm as its
    # activations and scales its sums by rsqrt(mean(h^2) + eps) in its epilogue. No norm launch and nothing
    # before the consumer's first mma (PRE_NORM's prologue forms the row in every block); other bits than
    # the norm on its own (rounded once, after the product), the same at every decode row count. H100 tg128
    # (docs/PERF.md, session 30): llama-8b int4 441.5 -> 461.3, int8 315.0 -> 325.5, llama-1b int4 1,554 ->
    # 1,631, SmolLM2 int4 2,317 -> 2,494 (over PRE_NORM's prologue); 8 streams, with the consumer's rows
    # reduced a warp each (launchers.RSCALE_PAR_ROWS; session 31): int4 2,985 -> 3,076, int8 -> 2,343.
    SPLIT_NORM = True
    # SPLIT_NORM on the mma route too (bf16's pipeline; the same kernels' epilogue), in place of PRE_NORM's
    # prologue and, past one row, of the norm's launch. Off: H100 llama-8b bf16 tg128 185.3 -> 175.7 (-5 %)
    # at one stream, 1,271 -> 1,291 (+1.6 %) at 8 (docs/PERF.md, session 31; decode_variants.py label u);
    # session 32: 180.3 -> 176.0 (-2.4 %), the qkv 1.2 us faster, gate_up 1.7 us slower (its activations no
    # longer PRE_NORM's shared-memory row).
    SPLIT_MMA = False

    def linear_add_rms_norm(self, x: torch.Tensor, w: Weight, residual: torch.Tensor, norm: torch.Tensor,
                            eps: float, then: Weight | None = None) -> torch.Tensor:
        """add_rms_norm(linear(x, w), residual, norm, eps); with FUSE_NORM, on the decode route of one
        row one launch where w's gemv epilogue is tile_epilogue (the norm by the block that finishes
        last, the same bits). Past one row that last block's norms cost more than the launch they save
        (int4 llama-8b, 8 streams: 1,745 fused against 2,362 tok/s unfused, docs/PERF.md).
        then: the weight of the one linear / gated_linear that consumes the result before `residual` is
        used again (a promise of the caller); with PRE_NORM the norm may be left to that gemv's prologue,
        and the result is then linear(x, w), with SPLIT_NORM residual * norm, which only `then` may take
        (see Deferred)."""
        n = x.shape[0]
        behind = self._deferred
        split = self._split_ok(w, then)
        if behind is not None and not (behind.residual is residual and behind.parts is None and not split
                                       and self._catchup_ok(w, n)):
            self._settle(add_only=behind.residual is residual)
            behind = None
        self._deferred = None
        if split:
            hw, parts = self._empty(n, w.rows), torch.empty(n, w.rows // 16, dtype=torch.float32, device=self.device)
            for r in range(0, n, L.MAX_GEMV_ROWS):
                s = slice(r, r + L.MAX_GEMV_ROWS)
                L.gemv(self.kc, x[s], w.fmt, w.parts, hw[s], w.route, self._mma(w, w.route),
                       hwout=(residual[s], norm, parts[s]))
            self._deferred = Deferred(hw, then, residual, norm, eps, parts)
            return hw
        defer = self._defer_ok(then, n)
        if behind is not None or defer:
            if behind is not None:  # the residual caught up in this gemv's epilogue
                y = self._empty(n, w.rows)
                L.gemv(self.kc, x, w.fmt, w.parts, y, w.route, self._mma(w, w.route), catchup=(behind.y, residual))
            else:
                y = self.linear(x, w)
            if not defer:
                return self.add_rms_norm(y, residual, norm, eps)
            self._deferred = Deferred(y, then, residual, norm, eps)
            return y
        if not (self.FUSE_NORM and self.ctx.decode and n == 1 and self._norm_route(w)):
            return self.add_rms_norm(self.linear(x, w), residual, norm, eps)
        y, out = self._empty(n, w.rows), torch.empty_like(residual)
        fused = (residual, norm, out, eps, self.norm_counter)
        if w.fmt.blocks:
            B.gemv_blocks(self.kc, x, w.fmt, w.parts[""], y, BLOCK_ROUTES[w.route], norm=fused)
        else:
            L.gemv(self.kc, x, w.fmt, w.parts, y, w.route, self._mma(w, w.route), norm=fused)
        return out

    def _catchup_ok(self, w: Weight, n: int) -> bool:
        """Whether w's decode gemv can add a deferred output into the residual in its epilogue."""
        return (self.ctx.decode and n <= L.MAX_GEMV_ROWS and self.dtype == torch.bfloat16 and w.route in L.GLU_ROUTES
                and not w.segments and not w.fmt.blocks and w.bias is None)

    def _split_ok(self, w: Weight, then: Weight | None) -> bool:
        """Whether the residual norm after w's decode gemv can be split between it and `then`'s
        (SPLIT_NORM): both tiled (or mma, SPLIT_MMA), plain weights; bf16 rows whose width fits the
        consumer's epilogue."""
        if not (self.SPLIT_NORM and then is not None and self.ctx.decode and self.dtype == torch.bfloat16):
            return False
        H = self.config.hidden_size
        routes = ("tiled", "mma") if self.SPLIT_MMA else ("tiled",)
        return (w.route in routes and then.route in routes and w.rows == H and H % 64 == 0
                and H <= L.RSCALE_MAX_K
                and w.bias is None and not (w.segments or then.segments or w.fmt.blocks or then.fmt.blocks))

    def _defer_ok(self, then: Weight | None, n: int) -> bool:
        """Whether the norm can go into the prologue of `then`'s decode gemv (one bf16 row; the mma
        route's bf16 pipeline, or the tiled route up to PRE_NORM_SMALL bytes of weight; the row fitting
        its shared memory), and the residual gemv's output kept for it."""
        if not (self.PRE_NORM and then is not None and self.ctx.decode and n == 1 and self.dtype == torch.bfloat16):
            return False
        H = self.config.hidden_size
        if then.segments or then.fmt.blocks or L.xsmem_bytes(1, then.rows, H, False, force=1) == 0 \
                or L.rmsnorm_threads(H) > min(L.TILED_WARPS, L.MMA_WARPS) * 32:
            return False
        if then.route == "mma":
            return then.fmt.format == "bf16" and self.profile.mma_pipe != 0
        return then.route == "tiled" and sum(p.nbytes for p in then.parts.values()) <= self.PRE_NORM_SMALL

    def _prenorm(self, x: torch.Tensor, w: Weight) -> tuple[torch.Tensor, tuple | None, tuple | None]:
        """(x, the gemv's prenorm, its rscale) for a linear / gated_linear of x by w: the deferred norm's
        arguments where x is its output and w its `then` (a split norm's as rscale); where x is that
        output but w another weight, the norm run now (x replaced by the normed row)."""
        d = self._deferred
        if d is None or x is not d.y:
            return x, None, None
        if w is d.then and d.parts is not None:
            self._deferred = None  # nothing left behind: the residual is whole
            return x, None, (d.parts, d.eps)
        if w is d.then:
            return x, (d.residual, d.norm, d.eps), None
        return self._settle(), None, None

    def _settle(self, add_only: bool = False) -> torch.Tensor | None:
        """The deferred norm run on its own: residual += y (add_only) or add_rms_norm -> the normed row
        (a split norm: the residual is whole already, the normed row rms_norm(residual))."""
        d, self._deferred = self._deferred, None
        if d.parts is not None:
            return None if add_only else self.rms_norm(d.residual, d.norm, d.eps)
        if add_only:
            d.residual.add_(d.y)  # bf16 add in fp32, rounded once: rmsnorm_residual's add
            return None
        return self.add_rms_norm(d.y, d.residual, d.norm, d.eps)

    def _norm_route(self, w: Weight) -> bool:
        """Whether w's decode gemv can fuse the residual norm: one format, no bias, a tile_epilogue route."""
        if w.segments or w.bias is not None or w.rows % 8:
            return False
        return BLOCK_ROUTES[w.route] in B.GLU_ROUTES if w.fmt.blocks else w.route in L.GLU_ROUTES

    def linear(self, x: torch.Tensor, w: Weight) -> torch.Tensor:
        x, prenorm, rscale = self._prenorm(x, w)
        n, N = x.shape[0], w.rows
        if rscale is not None:
            y = self._empty(n, N)
            self._rscaled(x, w, y, rscale)
        elif prenorm is not None:
            y = self._empty(n, N)
            L.gemv(self.kc, x, w.fmt, w.parts, y, w.route, self._mma(w, w.route), prenorm=prenorm)
        elif self.ctx.decode:
            y = self._empty(n, N)
            for r in range(0, n, L.MAX_GEMV_ROWS):  # verify steps have more rows than one gemv takes
                self._gemv(x[r:r + L.MAX_GEMV_ROWS], w, y[r:r + L.MAX_GEMV_ROWS])
        else:
            w_t = self.dense(w).t()
            y = block_mm(x, w_t, self.profile.prompt_rows, self._call_rows(w_t))
        if w.bias is not None:
            y.add_(w.bias)
        return y

    def _copy_bytes(self, w: Weight) -> int:
        """The bytes of the copy dense(w) writes; 0 where it returns the stored tensor."""
        if not (w.segments or w.fmt.blocks or w.fmt.quantized or w.parts[""].dtype != self.dtype):
            return 0
        k = in_features(w.segments[0].fmt, w.segments[0].parts[""]) if w.segments else in_features(w.fmt, w.parts[""])
        return w.rows * k * self.dtype.itemsize

    def _call_rows(self, w_t: torch.Tensor) -> int:
        key = tuple(w_t.shape)
        if key not in self.call_rows:
            self.call_rows[key] = prompt_call_rows(w_t, self.profile.prompt_rows)
        return self.call_rows[key]

    def _gemv(self, x: torch.Tensor, w: Weight, out: torch.Tensor, glu: str = "") -> None:
        """out [M, N] = x @ W^T (M <= 8) by each segment's route (glu: fused gated activation, out [M, N/2])."""
        if glu:
            if w.fmt.blocks:
                B.gemv_blocks(self.kc, x, w.fmt, w.parts[""], out, BLOCK_ROUTES[w.route], glu=glu)
            else:
                L.gemv(self.kc, x, w.fmt, w.parts, out, w.route, self._mma(w, w.route), glu=glu)
        elif w.segments:
            r0 = 0
            for seg in w.segments:
                self._gemv(x, seg, out[:, r0:r0 + seg.rows])
                r0 += seg.rows
        elif w.fmt.blocks:
            B.gemv_blocks(self.kc, x, w.fmt, w.parts[""], out, BLOCK_ROUTES[w.route])
        elif w.route == CUBLAS and out.dtype == x.dtype:  # 8 padded rows: one cuBLAS shape whatever M is
            out.copy_(block_mm(x, w.parts[""].t(), L.MAX_GEMV_ROWS))
        elif w.route == CUBLAS:  # fp32 logits: a gemv kernel (cuBLAS would round them to the activation dtype)
            route = self._gemv_kernel(w)
            L.gemv(self.kc, x, w.fmt, w.parts, out, route, self._mma(w, route))
        else:
            L.gemv(self.kc, x, w.fmt, w.parts, out, w.route, self._mma(w, w.route))

    def _rscaled(self, x: torch.Tensor, w: Weight, out: torch.Tensor, rscale: tuple, glu: str = "") -> None:
        """out = the gemv of a split norm's h * norm rows x by w, scaled by each row's rinv (rscale: (parts,
        eps)), in MAX_GEMV_ROWS pieces."""
        parts, eps = rscale
        for r in range(0, x.shape[0], L.MAX_GEMV_ROWS):
            s = slice(r, r + L.MAX_GEMV_ROWS)
            L.gemv(self.kc, x[s], w.fmt, w.parts, out[s], w.route, self._mma(w, w.route), glu=glu,
                   rscale=(parts[s], eps))

    def _mma(self, w: Weight, route: str) -> dict[str, int] | None:
        """The profile's MMA_PIPE for a bf16 weight on the mma route; None: launchers.mma_variant's rule."""
        pipe = self.profile.mma_pipe
        return {"MMA_PIPE": pipe} if pipe is not None and route == "mma" and w.fmt.format == "bf16" else None

    def dense(self, w: Weight, out: torch.Tensor | None = None) -> torch.Tensor:
        """w as [N, K] in the activation dtype: the stored tensor where it is one, else a fresh copy
        (or `out`) expanded by the dequantize kernels (torch where no kernel takes the format); the
        prompt copy where w keeps one."""
        if w.prompt_copy is not None:
            return w.prompt_copy if out is None else out.copy_(w.prompt_copy)
        if w.segments:
            K = in_features(w.segments[0].fmt, w.segments[0].parts[""])
            out = out if out is not None else self._empty(w.rows, K)
            r0 = 0
            for seg in w.segments:
                self.dense(seg, out[r0:r0 + seg.rows])
                r0 += seg.rows
            return out
        if w.fmt.blocks:
            out = out if out is not None else self._empty(w.rows, in_features(w.fmt, w.parts[""]))
            B.dequant_blocks(self.kc, w.fmt, w.parts[""], out)
            return out
        if out is not None:
            return out.copy_(self.dense(w))
        t = w.parts[""]
        if t.dtype == self.dtype and not w.fmt.quantized:
            return t
        if w.fmt.quantized and w.fmt.group_size % 32 == 0:
            out = self._empty(t.shape[0], t.shape[1] * (2 if w.fmt.format == "int4" else 1))
            L.dequantize_weight(self.kc, w.fmt, w.parts, out, w.route)
            return out
        return dequantize(w.fmt, L.gemv_unpack(w.route, w.fmt, w.parts), self.dtype)

    def gated_linear(self, x: torch.Tensor, w: Weight, activation: str = "silu") -> torch.Tensor:
        """act(x @ gate^T) * (x @ up^T) for w = linear_weight([gate, up], glu=True): on the decode route
        one gemv whose epilogue applies the activation (a glu weight), else the projection into the
        activation dtype, then the swiglu / geglu kernel (the same bits either way)."""
        kernel = {"silu": L.swiglu, "gelu_tanh": L.geglu}[activation]
        x, prenorm, rscale = self._prenorm(x, w)
        n = x.shape[0]
        if rscale is not None:
            y = self._empty(n, w.rows // 2 if w.glu else w.rows)
            self._rscaled(x, w, y, rscale, glu=activation if w.glu else "")
            if w.glu:
                return y
            out = self._empty(n, w.rows // 2)
            kernel(self.kc, y, out, interleaved=False)
            return out
        if prenorm is not None and w.glu:
            y = self._empty(n, w.rows // 2)
            L.gemv(self.kc, x, w.fmt, w.parts, y, w.route, self._mma(w, w.route), glu=activation, prenorm=prenorm)
            return y
        if prenorm is not None:  # then was not a glu weight: the norm on its own
            x = self._settle()
        if self.ctx.decode and w.glu:
            y = self._empty(n, w.rows // 2)
            for r in range(0, n, L.MAX_GEMV_ROWS):
                self._gemv(x[r:r + L.MAX_GEMV_ROWS], w, y[r:r + L.MAX_GEMV_ROWS], glu=activation)
            return y
        gate_up = self.linear(x, w)
        out = self._empty(n, gate_up.shape[1] // 2)
        kernel(self.kc, gate_up, out, interleaved=w.glu)
        return out

    def sigmoid_gate(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        G.sigmoid_gate(self.kc, x, gate, x)
        return x

    def attention(self, layer: int, qkv: torch.Tensor, q_norm: torch.Tensor | None = None,
                  k_norm: torch.Tensor | None = None) -> torch.Tensor:
        """qkv [T, (heads + 2 * kv_heads) * d] (q | k | v, maybe a view of a wider projection; q is
        rotated in place) -> [T, heads * d]."""
        ctx, c = self.ctx, self.config
        T, D, Hq, Hkv = qkv.shape[0], c.head_dim, c.num_attention_heads, c.num_key_value_heads
        q = qkv[:, :Hq * D].view(T, Hq, D)
        k = qkv[:, Hq * D:(Hq + Hkv) * D].view(T, Hkv, D)
        v = qkv[:, (Hq + Hkv) * D:].view(T, Hkv, D)
        cos, sin = self.layer_rope[layer]
        window, softcap = self.layers[layer].window, c.attn_logit_softcapping
        scales = (ctx.k_scale[layer], ctx.v_scale[layer]) if ctx.k_scale else (None, None)
        out = self._empty(T, Hq, D)
        if (ctx.decode and ctx.verify_width <= 1
                and L.rope_attention_decode_ok(q, ctx.k_cache[layer], self.rotary_dim, q_norm is not None)):
            # one launch: RoPE, the K/V write and the attention (the same bits as the two kernels below)
            L.rope_attention_decode(self.kc, q, k, v, cos, sin, ctx.positions, ctx.kv_slots, ctx.k_cache[layer],
                                    ctx.v_cache[layer], ctx.block_tables, ctx.seq_lens, ctx.max_context, out,
                                    self.scale, self.profile.attention_partition, ctx.workspace,
                                    window=window, softcap=softcap, route=self._decode_route(layer))
            return out.view(T, -1)
        if scales[0] is None:
            L.rope_kv_write(self.kc, q, k, v, cos, sin, ctx.positions, ctx.kv_slots, ctx.k_cache[layer],
                            ctx.v_cache[layer], q_norm, k_norm, c.rms_norm_eps, rotary_dim=self.rotary_dim)
        else:  # a compressed cache: rotate k into rows [T, 1, Hkv, D] (slot t), then quantize into the pages
            k_rows, v_rows = self._empty(T, 1, Hkv, D), self._empty(T, 1, Hkv, D)
            rows = torch.arange(T, dtype=torch.int32, device=self.device)
            L.rope_kv_write(self.kc, q, k, v, cos, sin, ctx.positions, rows, k_rows, v_rows, q_norm,
                            k_norm, c.rms_norm_eps, rotary_dim=self.rotary_dim)
            L.kv_quantize_write(self.kc, k_rows.view(T, Hkv, D), v_rows.view(T, Hkv, D), ctx.kv_slots,
                                ctx.k_cache[layer], ctx.v_cache[layer], *scales)
        if ctx.decode:
            L.paged_attention_decode(self.kc, q, ctx.k_cache[layer], ctx.v_cache[layer], ctx.block_tables,
                                     ctx.seq_lens, ctx.max_context, out, self.scale,
                                     self.profile.attention_partition, ctx.workspace,
                                     window=window, softcap=softcap, k_scale=scales[0], v_scale=scales[1],
                                     route=self._decode_route(layer))
        else:  # the mma route reads bf16 caches only: a compressed cache (or a window / soft-cap) takes warp
            route = self.prefill_attention if not (window or softcap or scales[0] is not None) else "warp"
            L.paged_attention_prefill(self.kc, q, ctx.k_cache[layer], ctx.v_cache[layer], ctx.block_tables,
                                      ctx.cu_seqlens, ctx.seq_lens, ctx.max_context, out, self.scale, route,
                                      window=window, softcap=softcap, k_scale=scales[0], v_scale=scales[1])
        return out.view(T, -1)

    def prompt_graph_ok(self) -> bool:
        """Whether a CUDA graph can hold a prompt forward, and holds little memory: every prompt
        attention launch takes the mma route (its grid and reads fixed by the chunk's padded row
        count, the sequence's extent read on the device; with a bf16 / fp32 cache: a compressed one
        takes warp), and no projection is expanded per chunk (the graph's pool would keep the largest
        expanded weight, a quarter GiB for an 8B model's gate_up, beside the eager allocator's)."""
        return (self.prefill_attention == "mma" and not self.config.attn_logit_softcapping
                and not any(a.window for a in self.layers) and not self.expands)

    def _decode_route(self, layer: int) -> str:
        """The profile's decode attention route where it takes this layer's cache, else warp (decided
        once per cache layout: page size and compression are fixed for the runner's life)."""
        cache = self.ctx.k_cache[layer]
        key = (cache.shape[1], bool(self.ctx.k_scale))
        if key not in self._decode_routes:
            c, route = self.config, self.profile.decode_attention
            ok = L.attention_decode_route_ok(route, self.dtype, c.head_dim,
                                             c.num_attention_heads // c.num_key_value_heads, *key)
            self._decode_routes[key] = route if ok else "warp"
        return self._decode_routes[key]

    def short_conv(self, layer: int, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx = self.ctx
        out = self._empty(*x.shape)
        if ctx.verify_width > 1:
            for rows in self._verify_positions(x.shape[0]):
                y = self._empty(rows.shape[0], x.shape[1])
                G.short_conv(self.kc, x.index_select(0, rows), weight, ctx.conv[layer], ctx.cu_seqlens,
                             ctx.state_slots, y)
                out.index_copy_(0, rows, y)
                ctx.verify_conv[layer].index_copy_(0, rows, ctx.conv[layer].index_select(0, ctx.state_slots.long()))
            return out
        G.short_conv(self.kc, x, weight, ctx.conv[layer], ctx.cu_seqlens, ctx.state_slots, out)
        return out

    def gated_delta_rule(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor,
                         b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor) -> torch.Tensor:
        ctx = self.ctx
        out = self._empty(*v.shape)
        if ctx.verify_width > 1:
            for rows in self._verify_positions(v.shape[0]):
                y = self._empty(rows.shape[0], *v.shape[1:])
                pick = [t.index_select(0, rows) for t in (q, k, v, a, b)]
                G.gated_delta_rule(self.kc, *pick, A_log, dt_bias, ctx.ssm[layer], ctx.cu_seqlens, ctx.state_slots, y)
                out.index_copy_(0, rows, y)
                ctx.verify_ssm[layer].index_copy_(0, rows, ctx.ssm[layer].index_select(0, ctx.state_slots.long()))
            return out
        G.gated_delta_rule(self.kc, q, k, v, a, b, A_log, dt_bias, ctx.ssm[layer], ctx.cu_seqlens,
                           ctx.state_slots, out)
        return out

    def _verify_positions(self, rows: int) -> list[torch.Tensor]:
        """Row indices [B] int64 of position i of every sequence, for i in 0..verify_width-1."""
        W = self.ctx.verify_width
        base = torch.arange(0, rows, W, dtype=torch.int64, device=self.device)
        return [base + i for i in range(W)]

    def gated_rms_norm(self, x: torch.Tensor, z: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        out = torch.empty_like(x)
        G.gated_rms_norm(self.kc, x, z, w, out, eps)
        return out

    def logits(self, x: torch.Tensor, w: Weight, out: torch.Tensor | None = None) -> torch.Tensor:
        """x [n, hidden] -> [n, vocab] float32, by the gemv kernel in groups of its row limit."""
        n = x.shape[0]
        out = out if out is not None else self._empty(n, w.rows, dtype=torch.float32)
        for s in range(0, n, L.MAX_GEMV_ROWS):
            self._gemv(x[s:s + L.MAX_GEMV_ROWS], w, out[s:s + L.MAX_GEMV_ROWS])
        return out

    def soft_cap(self, x: torch.Tensor, cap: float) -> torch.Tensor:
        """x -> cap * tanh(x / cap), in place (final logit soft-capping; fp32 logits)."""
        return x.div_(cap).tanh_().mul_(cap)


    def _gemv_kernel(self, w: Weight) -> str:
        """The gemv kernel for a cublas-route (unquantized) weight's fp32 logits."""
        return "mma" if L.gemv_route_ok("mma", w.fmt, w.parts[""].shape[1], self.dtype) else "warp"


def rope_tables(rope: Rope, positions: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [positions, rope.dim / 2] fp32 for rope_kv_write: angles in float64 (scaled inverse
    frequencies at each position's interpolated position), times the attention factor."""
    angles = rope.angles(positions, torch.float64)
    factor = rope.attention_factor()
    return ((angles.cos() * factor).to(torch.float32).to(device),
            (angles.sin() * factor).to(torch.float32).to(device))


def block_mm(x: torch.Tensor, w_t: torch.Tensor, rows: int, call_rows: int = 0) -> torch.Tensor:
    """x [n, K] @ w_t [K, N] in blocks of exactly `rows` rows, the last one zero-padded: cuBLAS
    sees one shape whatever n is, so a row's bits do not depend on the others. call_rows (a multiple
    of rows, where calls_keep_rows found that one call over any whole number of blocks up to it gives
    each row the bits of its lone block): one torch.mm per call_rows rows instead of one per block."""
    n = x.shape[0]
    total = -(-n // rows) * rows
    if total != n or not x.is_contiguous():
        padded = torch.zeros(total, x.shape[1], dtype=x.dtype, device=x.device)
        padded[:n] = x
        x = padded
    step = max(rows, call_rows)
    if total <= step:  # one call (a prompt chunk up to call_rows)
        y = torch.mm(x, w_t)
        return y if total == n else y[:n]
    y = torch.empty(total, w_t.shape[1], dtype=x.dtype, device=x.device)
    for r0 in range(0, total, step):
        torch.mm(x[r0:r0 + step], w_t, out=y[r0:r0 + step])
    return y[:n]


def no_split_k() -> bool:
    """Keep split-K out of torch's cuBLAS matmuls in this process (its cuBLASLt backend, fp16 / bf16
    reductions in fp32 and never split over K): the kernels left sum each output along K in one
    order, whatever the row count, so one call over a whole prompt can keep a row's bits (split-K's
    choice moves with the row count; scripts/gemm_row_bits.py). False where this torch cannot."""
    try:
        torch.backends.cuda.preferred_blas_library("cublaslt")
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = (False, False)
        torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = (False, False)
    except (AttributeError, RuntimeError, TypeError):
        return False
    return True


def prompt_call_rows(w_t: torch.Tensor, rows: int) -> int:
    """block_mm's call_rows for the prompt matmuls by w_t [K, N] in blocks of `rows`: the most rows
    one call takes (PROMPT_CALL_ROWS) where cuBLAS, kept from split-K, keeps each row's bits at every
    block count up to that, else 0 (one call per block)."""
    most = max(rows, PROMPT_CALL_ROWS // rows * rows)
    return most if no_split_k() and calls_keep_rows(w_t, rows, most) else 0


def calls_keep_rows(w_t: torch.Tensor, rows: int, most: int) -> bool:
    """Whether one torch.mm by w_t [K, N] over any whole number of `rows`-row blocks up to `most`
    rows gives every row the bits block_mm's lone blocks give (random activations: cuBLAS picks its
    kernel by shape, not values; memory: two [most, N] outputs beside the weight)."""
    g = torch.Generator(device=w_t.device).manual_seed(w_t.shape[0])
    x = torch.randn(most, w_t.shape[0], generator=g, device=w_t.device, dtype=w_t.dtype)
    ref = block_mm(x, w_t, rows)
    return all(torch.equal(torch.mm(x[:n], w_t), ref[:n]) for n in range(rows, most + 1, rows))
