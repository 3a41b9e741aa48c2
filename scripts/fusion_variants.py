"""ninfer bench with decode fusions turned off past one row, by monkeypatching CudaOps (the experiment behind
docs/PERF.md "fewer launches per decode step"): argv[1] in {none, norm, norm+glu, glu, fused-norm,
no-copies}; the rest: bench args. Since c704338 the norm fusion is one-row only in the code, so "none" and "norm" run the same path;
since bc4401f it is off (CudaOps.FUSE_NORM), and "fused-norm" turns it back on at one row ("the residual
norm back in its own launch"). "no-copies" sets CudaOps.PROMPT_COPY_BYTES to 0: no prompt copies
of quantized weights kept from the load ("quantized prefill: ... a small model's copies kept").
"""
import runpy, sys
import ninfer.engine.ops.cuda_ops as C
which = sys.argv[1]
if which == "fused-norm":
    C.CudaOps.FUSE_NORM = True
if which == "no-copies":
    C.CudaOps.PROMPT_COPY_BYTES = 0
if "norm" in which:
    orig_norm = C.CudaOps.linear_add_rms_norm
    def norm(self, x, w, residual, n, eps):
        if x.shape[0] > 1:
            return self.add_rms_norm(self.linear(x, w), residual, n, eps)
        return orig_norm(self, x, w, residual, n, eps)
    C.CudaOps.linear_add_rms_norm = norm
if "glu" in which:
    orig_glu = C.CudaOps.gated_linear
    L = C.L
    def glu(self, x, w, activation="silu"):
        if x.shape[0] > 1 and self.ctx.decode and w.glu:
            kernel = {"silu": L.swiglu, "gelu_tanh": L.geglu}[activation]
            gate_up = self.linear(x, w)
            out = self._empty(x.shape[0], gate_up.shape[1] // 2)
            kernel(self.kc, gate_up, out, interleaved=True)
            return out
        return orig_glu(self, x, w, activation)
    C.CudaOps.gated_linear = glu
sys.argv = ["ninfer", "bench", *sys.argv[2:]]
runpy.run_module("ninfer.cli.main", run_name="__main__")
