"""CudaOps' deferred residual norms (PRE_NORM and SPLIT_NORM: linear_add_rms_norm's `then`) on the CPU:
the kernel launchers replaced by torch references of what they compute, a llama forward with the
deferral against the same forward without it: the same hidden rows and residual (PRE_NORM; SPLIT_NORM's
rows within bf16 rounding), every deferred norm taken by its `then` gemv and caught up by the next
residual gemv, and the fallbacks (a consumer other than `then`, a residual gemv that cannot catch up)
running the norm on its own. The kernels themselves are checked on a GPU (tests/gpu/test_prenorm.py)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from ninfer.engine.models.llama import MLP, Attention, DecoderLayer, LlamaModel
from ninfer.engine.ops import cuda_ops
from ninfer.engine.ops.cuda_ops import CudaOps, Weight
from ninfer.engine.quant import TensorFormat
from ninfer.kernels import launchers as L
from ninfer.kernels.profile import DeviceProfile

BF = torch.bfloat16
H, LAYERS = 64, 3


def rmsnorm(h: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    f = h.float()
    return (f * torch.rsqrt(f.pow(2).mean(-1, keepdim=True) + eps) * w.float()).to(BF)


class FakeLaunchers:
    """launchers.gemv / rmsnorm_residual as torch computations, counting the fused arguments."""

    def __init__(self) -> None:
        self.seen = {"prenorm": 0, "catchup": 0, "norm": 0, "hwout": 0, "rscale": 0}

    def gemv(self, kc, x, fmt, parts, out, route, variant=None, glu="", norm=None, prenorm=None, catchup=None,
             hwout=None, rscale=None):
        if prenorm is not None:
            residual, w, eps = prenorm
            x = rmsnorm((residual.float() + x.float()).to(BF), w, eps)
            self.seen["prenorm"] += 1
        y = x.float() @ parts[""].float().T
        if hwout is not None:  # residual += y, out = residual * w, parts: sums of squares of 16 columns
            residual, w, sums = hwout
            h = (residual.float() + y.to(BF).float()).to(BF)
            residual.copy_(h)
            sums.copy_(h.float().pow(2).view(h.shape[0], -1, 16).sum(-1))
            y = h.float() * w.float()
            self.seen["hwout"] += 1
        if rscale is not None:
            sums, eps = rscale
            y = y * torch.rsqrt(sums.sum(-1, keepdim=True) / x.shape[1] + eps)
            self.seen["rscale"] += 1
        if glu:
            gate, up = y.chunk(2, dim=-1)
            y = torch.nn.functional.silu(gate.to(BF).float()) * up.to(BF).float()
        out.copy_(y.to(out.dtype))
        if catchup is not None:
            y_prev, residual = catchup
            residual.copy_((residual.float() + y_prev.float()).to(BF))
            self.seen["catchup"] += 1

    def rmsnorm_residual(self, kc, x, w, out, eps, residual=None):
        if residual is not None:
            residual.copy_((residual.float() + x.float()).to(BF))
            x = residual
        out.copy_(rmsnorm(x, w, eps))
        self.seen["norm"] += 1


class Ops(CudaOps):
    """CudaOps without a device: attention keeps the q columns, the embedding is given."""

    def __init__(self, pre_norm: bool, split_norm: bool = False) -> None:  # noqa: super().__init__ needs a GPU
        self.kc, self.dtype, self.device = None, BF, torch.device("cpu")
        self.config = SimpleNamespace(hidden_size=H)
        self.profile = DeviceProfile()
        self.PRE_NORM, self.SPLIT_NORM = pre_norm, split_norm
        self._deferred = None

    def attention(self, layer, qkv, q_norm, k_norm):
        return qkv[:, :H].contiguous()


def weight(rows: int, cols: int, seed: int, route: str = "tiled", glu: bool = False) -> Weight:
    g = torch.Generator().manual_seed(seed)
    return Weight(TensorFormat("bf16"), {"": (torch.randn(rows, cols, generator=g) * 0.2).to(BF)}, route=route,
                  glu=glu)


def model(o_route: str = "tiled") -> LlamaModel:
    def norm(seed: int) -> torch.Tensor:
        return (1 + 0.2 * torch.randn(H, generator=torch.Generator().manual_seed(seed))).to(BF)

    layers = []
    for i in range(LAYERS):
        attn = Attention(weight(3 * H, H, 10 * i), weight(H, H, 10 * i + 1, o_route), None, None)
        mlp = MLP(weight(4 * H, H, 10 * i + 2, glu=True), weight(H, 2 * H, 10 * i + 3))
        layers.append(DecoderLayer(norm(100 + i), attn, norm(200 + i), mlp))
    config = SimpleNamespace(rms_norm_eps=1e-6)
    final = (1 + 0.1 * torch.randn(H, generator=torch.Generator().manual_seed(9))).to(BF)
    return LlamaModel(config, None, layers, final, None)


def forward(m: LlamaModel, ops: Ops, rows: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    h = (torch.randn(rows, H, generator=torch.Generator().manual_seed(5)) * 2).to(BF)
    ops.embed = lambda ids, w, scale=1.0: h
    ops.begin(SimpleNamespace(decode=True))
    return m.forward(ops, torch.zeros(rows, dtype=torch.int32)), h


@pytest.fixture
def fake(monkeypatch) -> FakeLaunchers:
    f = FakeLaunchers()
    monkeypatch.setattr(L, "gemv", f.gemv)
    monkeypatch.setattr(L, "rmsnorm_residual", f.rmsnorm_residual)
    assert cuda_ops.L is L
    return f


def test_deferred_norms_match_and_are_taken(fake: FakeLaunchers) -> None:
    m = model()
    x0, h0 = forward(m, Ops(pre_norm=False))
    assert fake.seen == {"prenorm": 0, "catchup": 0, "norm": 1 + 2 * LAYERS, "hwout": 0, "rscale": 0}
    fake.seen = dict.fromkeys(fake.seen, 0)
    ops = Ops(pre_norm=True)
    x1, h1 = forward(m, ops)
    assert torch.equal(x1, x0) and torch.equal(h1, h0)
    # every norm but the last deferred to its consumer and caught up by the next residual gemv
    assert fake.seen == {"prenorm": 2 * LAYERS - 1, "catchup": 2 * LAYERS - 1, "norm": 2, "hwout": 0, "rscale": 0}
    assert ops._deferred is None


def test_deferral_needs_one_row_and_a_tiled_consumer(fake: FakeLaunchers) -> None:
    m = model()
    x0, h0 = forward(m, Ops(pre_norm=False), rows=2)
    x1, h1 = forward(m, Ops(pre_norm=True), rows=2)
    assert torch.equal(x1, x0) and torch.equal(h1, h0) and fake.seen["prenorm"] == 0
    for layer in m.layers:
        layer.mlp.gate_up.route = "warp"
    fake.seen = dict.fromkeys(fake.seen, 0)
    x2, h2 = forward(m, Ops(pre_norm=True))
    x3, h3 = forward(m, Ops(pre_norm=False))
    assert torch.equal(x2, x3) and torch.equal(h2, h3)
    assert fake.seen["prenorm"] == LAYERS - 1  # only the qkv consumers


def test_a_larger_tiled_consumer_keeps_its_own_norm(fake: FakeLaunchers, monkeypatch) -> None:
    """Over PRE_NORM_SMALL bytes a tiled consumer does not take the norm, even where launchers' rule
    stages its activations in shared memory anyway (every block would form the row: measured slower)."""
    m = model()
    x0, h0 = forward(m, Ops(pre_norm=False))
    ops = Ops(pre_norm=True)
    ops.PRE_NORM_SMALL = 0
    monkeypatch.setattr(L, "XSMEM_MIN_N", 4 * H)  # the gate_up weights staged by the rule
    fake.seen = dict.fromkeys(fake.seen, 0)
    x1, h1 = forward(m, ops)
    assert torch.equal(x1, x0) and torch.equal(h1, h0) and fake.seen["prenorm"] == 0
    ops.PRE_NORM_SMALL = 3 * H * H * 2  # the qkv weights (bf16), not gate_up's 4 H rows
    fake.seen = dict.fromkeys(fake.seen, 0)
    x2, h2 = forward(m, ops)
    assert torch.equal(x2, x0) and torch.equal(h2, h0)
    assert fake.seen["prenorm"] == fake.seen["catchup"] == LAYERS - 1


def test_bf16_consumers_on_the_mma_pipeline(fake: FakeLaunchers) -> None:
    """bf16 weights on the mma route take the norm where their pipeline runs (not with a profile's
    MMA_PIPE 0, the built-in loop)."""
    m = model()
    for layer in m.layers:
        for w in (layer.attn.qkv, layer.attn.o_proj, layer.mlp.gate_up, layer.mlp.down):
            w.route = "mma"
    x0, h0 = forward(m, Ops(pre_norm=False))
    fake.seen = dict.fromkeys(fake.seen, 0)
    x1, h1 = forward(m, Ops(pre_norm=True))
    assert torch.equal(x1, x0) and torch.equal(h1, h0)
    assert fake.seen["prenorm"] == fake.seen["catchup"] == 2 * LAYERS - 1
    ops = Ops(pre_norm=True)
    ops.profile = DeviceProfile(mma_pipe=0)
    fake.seen = dict.fromkeys(fake.seen, 0)
    x2, _ = forward(m, ops)
    assert torch.equal(x2, x0) and fake.seen["prenorm"] == 0


def test_a_consumer_with_bias(fake: FakeLaunchers) -> None:
    """qkv with a bias (qwen2): the prologue gemv, then the bias, as without the deferral."""
    m = model()
    for i, layer in enumerate(m.layers):
        layer.attn.qkv.bias = torch.randn(3 * H, generator=torch.Generator().manual_seed(50 + i)).to(BF)
    x0, h0 = forward(m, Ops(pre_norm=False))
    fake.seen = dict.fromkeys(fake.seen, 0)
    x1, h1 = forward(m, Ops(pre_norm=True))
    assert torch.equal(x1, x0) and torch.equal(h1, h0) and fake.seen["prenorm"] == 2 * LAYERS - 1


def test_residual_gemv_without_catchup_settles(fake: FakeLaunchers) -> None:
    """o_proj on a route without the epilogue: the deferred add runs on its own before it."""
    m = model(o_route="warp")
    x0, h0 = forward(m, Ops(pre_norm=False))
    fake.seen = dict.fromkeys(fake.seen, 0)
    x1, h1 = forward(m, Ops(pre_norm=True))
    assert torch.equal(x1, x0) and torch.equal(h1, h0)
    assert fake.seen["catchup"] == LAYERS  # the down projections only


@pytest.mark.parametrize("split", [False, True], ids=["pre_norm", "split_norm"])
def test_a_consumer_other_than_then_gets_the_normed_row(fake: FakeLaunchers, split: bool) -> None:
    """A deferred norm (PRE_NORM's, or SPLIT_NORM's with the residual already whole) taken by a weight
    other than `then`: the norm runs on its own, the same rows and residual as without the deferral."""
    ops = Ops(pre_norm=True, split_norm=split)
    ops.begin(SimpleNamespace(decode=True))
    w_o, then, other = weight(H, H, 1), weight(2 * H, H, 2), weight(2 * H, H, 3)
    norm = (1 + 0.2 * torch.randn(H, generator=torch.Generator().manual_seed(7))).to(BF)
    x = (torch.randn(1, H, generator=torch.Generator().manual_seed(4))).to(BF)
    h = (torch.randn(1, H, generator=torch.Generator().manual_seed(6))).to(BF)
    h_ref = h.clone()
    y = ops.linear_add_rms_norm(x, w_o, h, norm, 1e-6, then=then)
    assert ops._deferred is not None and (ops._deferred.parts is not None) == split
    assert split or torch.equal(h, h_ref)  # PRE_NORM: the residual is one add behind
    out = ops.linear(y, other)
    ref = Ops(pre_norm=False)
    ref.begin(SimpleNamespace(decode=True))
    normed = ref.linear_add_rms_norm(x, w_o, h_ref, norm, 1e-6)
    assert torch.equal(out, ref.linear(normed, other)) and torch.equal(h, h_ref)
    assert ops._deferred is None and fake.seen["prenorm"] == fake.seen["rscale"] == 0

def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Within a few bf16 roundings of each other, relative to the rows' size."""
    return ((a.float() - b.float()).norm() / b.float().norm()).item() < 0.02


@pytest.mark.parametrize("rows", [1, 2, 11])
def test_split_norms_between_tiled_gemvs(fake: FakeLaunchers, rows: int) -> None:
    """SPLIT_NORM: every norm between two tiled gemvs left to the pair (the residual gemv's hwout, the
    consumer's rscale) at any row count (11: two gemvs of up to 8 rows each), none on its own but the
    first and the last; the rows as the norms on their own give them, within bf16 rounding."""
    m = model()
    x0, h0 = forward(m, Ops(pre_norm=False), rows=rows)
    fake.seen = dict.fromkeys(fake.seen, 0)
    ops = Ops(pre_norm=True, split_norm=True)
    x1, h1 = forward(m, ops, rows=rows)
    pieces = -(-rows // L.MAX_GEMV_ROWS)
    assert fake.seen == {"prenorm": 0, "catchup": 0, "norm": 2, "hwout": pieces * (2 * LAYERS - 1),
                         "rscale": pieces * (2 * LAYERS - 1)}
    assert close(x1, x0) and close(h1, h0) and not torch.equal(x1, x0)
    assert ops._deferred is None


def test_split_norm_needs_tiled_gemvs_on_both_sides(fake: FakeLaunchers) -> None:
    """An mma consumer (qkv) or an mma residual gemv (o_proj): those norms as PRE_NORM takes them, the
    rest split; a pending PRE_NORM add is settled before a split norm's residual gemv."""
    m = model(o_route="mma")
    for layer in m.layers:
        layer.attn.qkv.route = "mma"
    x0, h0 = forward(m, Ops(pre_norm=False))
    fake.seen = dict.fromkeys(fake.seen, 0)
    ops = Ops(pre_norm=True, split_norm=True)
    ops.PRE_NORM_SMALL = 1 << 30
    x1, h1 = forward(m, ops)
    # o_proj (mma) -> gate_up: not split; down (tiled) -> the next qkv (mma): not split either
    assert fake.seen["hwout"] == fake.seen["rscale"] == 0
    for layer in m.layers:
        layer.attn.qkv.route = "tiled"
    fake.seen = dict.fromkeys(fake.seen, 0)
    x2, h2 = forward(m, ops)
    assert fake.seen["hwout"] == fake.seen["rscale"] == LAYERS - 1  # down -> the next qkv
    assert close(x2, x0) and close(h2, h0) and ops._deferred is None


@pytest.mark.parametrize("rows", [1, 8])
def test_split_mma_takes_the_mma_route_too(fake: FakeLaunchers, rows: int) -> None:
    """SPLIT_MMA: the norms between bf16 weights on the mma route split as between tiled ones (every
    projection mma, then o_proj alone mma beside tiled consumers), in place of PRE_NORM's prologue."""
    m = model(o_route="mma")
    for layer in m.layers:
        for w in (layer.attn.qkv, layer.mlp.gate_up, layer.mlp.down):
            w.route = "mma"
    x0, h0 = forward(m, Ops(pre_norm=False), rows=rows)
    ops = Ops(pre_norm=True, split_norm=True)
    ops.SPLIT_MMA = True
    for mixed in (False, True):
        if mixed:
            for layer in m.layers:
                for w in (layer.attn.qkv, layer.mlp.gate_up, layer.mlp.down):
                    w.route = "tiled"
        fake.seen = dict.fromkeys(fake.seen, 0)
        x1, h1 = forward(m, ops, rows=rows)
        assert fake.seen == {"prenorm": 0, "catchup": 0, "norm": 2, "hwout": 2 * LAYERS - 1,
                             "rscale": 2 * LAYERS - 1}, (mixed, fake.seen)
        assert close(x1, x0) and close(h1, h0) and ops._deferred is None
