"""Quantized GGUF linears of the fp32 CPU backend on oneDNN's bf16 GEMM (`weight_format="auto"`).

A Q8_0 weight dequantized to fp32 is read at 4 bytes a weight; as bf16 at 2, on oneDNN's bf16 GEMM (native on
AVX-512 BF16 / AMX, converted on other AVX-512 CPUs). Rounding the weight to bf16 moves a Q8_0 value d * q
(|q| <= 127) by at most half a quantization step. The default model's tied lm_head (49152 x 576, Q8_0) takes 2.2
ms a decode step this way instead of 12.8 ms in fp32 (2 EPYC cores, batch 1-8).

The GEMM returns bf16, whose 8 significant bits space logits near 20 by 0.125: rounded so, near-ties among a
row's top logits flip, and greedy output drifts from the fp32 weight's (measured: 10 of 11 prompts diverged
within 48 tokens, against 5 of 11 for the int4 decoder layers alone). `Bf16Logits` therefore recomputes, per
row, every logit the error bound cannot rule out as the row's largest, in float64 from the fp32 weight: greedy
tokens and the top logits are those of the fp32 weight; the tail keeps the bf16 values.
"""

from __future__ import annotations

import torch

from voltserve.backends.cpu import fixed_shape_linear

# bf16 GEMM rows per call: 8 rows cost what 1-4 cost (the weight's bytes bound it: 49152 x 576 on 2 cores 2.2 ms
# at 1-8 rows, 3.3 at 16); fixed, so that a row's result does not depend on the batch
BF16_ROW_CHUNK = 8
DENSE_CANDIDATES = 2048  # a row with more candidate logits is computed whole in fp32 (x = 0, flat rows)
BF16_UNIT_ROUNDOFF = 2.0 ** -8  # bf16 keeps 8 significant bits, round to nearest
FP32_UNIT_ROUNDOFF = 2.0 ** -24


def bf16_gemm_supported() -> bool:
    """torch's own check that oneDNN runs bf16 GEMMs on this CPU (AVX-512 or native bf16); False where the
    check is missing. Elsewhere bf16 products are emulated and slower than fp32."""
    check = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    try:
        return bool(check()) if check is not None else False
    except RuntimeError:
        return False


class Bf16Linear:
    """A linear on bf16 weights: x [num_tokens, in_features] -> [num_tokens, out_features] in x's dtype.

    x is rounded to bf16, the products are accumulated in fp32 by oneDNN and y comes back rounded to bf16 (as
    from `cpu_int4.Int4Linear`). Batch invariant: fixed BF16_ROW_CHUNK-row GEMMs.

    Args:
        weight: [out_features, in_features] float (the dequantized GGUF tensor).
    """

    def __init__(self, weight: torch.Tensor):
        self.weight = weight.to(torch.bfloat16).contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return fixed_shape_linear(x.to(torch.bfloat16), self.weight, BF16_ROW_CHUNK).to(x.dtype)


class Bf16Logits(Bf16Linear):
    """The lm_head: `Bf16Linear`'s logits, with those that may be a row's largest recomputed exactly.

    Each row of x is first scaled by a power of two (exact) so that its largest |x_i| lies in [1, 2): the bf16
    dot products flush subnormals to zero, and the bound below is relative. Error bound of a bf16 logit y''_v
    (scaled units) against the exact x . w_v (u = 2^-8 for bf16, 2^-24 for fp32's accumulation over k =
    in_features products; standard floating-point error analysis, e.g. Higham, "Accuracy and Stability of
    Numerical Algorithms", ch. 3):
        B_v = (2u + u^2 + 1.01 k u_fp32 (1 + u)^2) ||x|| ||w_v|| + u / (1 - u) |y''_v|
              + (k max(2, max|w|) + 1) 2^-126
    (the first term bounds sum_i |x_i w_vi| by Cauchy-Schwarz, `row_norms` holding ||w_v||; the last covers the
    flushed subnormals), padded by 1%, computed in float64. A logit with y''_v + B_v below max_u (y''_u - B_u)
    cannot be the row's largest (`_screen` tests a superset of the others: max_u (y''_u - B_u) replaced by the
    bound of the largest y''_t); every other one is recomputed in float64 from the fp32 weight (products exact;
    the value does not depend on the batch either) and returned rounded to fp32. A row whose largest logit is
    not finite (in fp32, scaled back), or with more than DENSE_CANDIDATES candidates (x = 0: all), is computed
    whole in fp32.

    So the argmax of the returned logits is that of x @ weight^T up to fp32 rounding of the top logits (two
    within an fp32 ulp tie, and the lower index wins); on the default model 2 logits a row are recomputed at the
    median, 39 at most (11 prompts x 48 tokens). The others keep their bf16 value: log-probabilities and
    temperature sampling see errors up to ~0.1 nats on the default model (median 0.02 over tokens of p > 1e-3);
    `weight_format="float"` is the fp32 reference.

    Args:
        weight: [vocab_size, hidden_size] fp32 (the dequantized GGUF tensor; kept for the recomputation).
    """

    def __init__(self, weight: torch.Tensor):
        super().__init__(weight)
        self.exact = weight.to(torch.float32).contiguous()
        self.row_norms = self.exact.norm(dim=-1).double()  # [vocab]
        self.max_row_norm = float(self.row_norms.max())
        k, u = weight.shape[1], BF16_UNIT_ROUNDOFF
        self.input_error = 1.01 * (2 * u + u * u + 1.01 * k * FP32_UNIT_ROUNDOFF * (1 + u) ** 2)
        self.output_error = 1.01 * u / (1 - u)
        self.flush_error = 1.01 * (k * max(2.0, float(self.exact.abs().max())) + 1) * 2.0 ** -126

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [num_tokens, hidden_size] -> logits [num_tokens, vocab_size] fp32."""
        x, y, rows, cols, dense = self._screen(x)
        y[rows, cols] = (self.exact[cols].double() * x[rows].double()).sum(dim=-1).float()
        if len(dense):
            y[dense] = torch.stack([torch.mv(self.exact, x[i]) for i in dense.tolist()])
        return y

    def candidates(self, x: torch.Tensor) -> torch.Tensor:
        """[num_tokens] int64: how many logits of each row `__call__` recomputes (for benchmarks and tests)."""
        _, y, rows, _, dense = self._screen(x)
        counts = torch.bincount(rows, minlength=x.shape[0])
        counts[dense] = y.shape[1]
        return counts

    def _screen(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(x fp32, the logits with the bf16 values, rows and columns of those that may be their row's
        largest, the rows to compute whole).

        Three passes over the logits: the row's largest bf16 logit y''_t bounds max_u (y''_u - B_u) from below
        (floor = y''_t - B_t); a logit is a candidate if y''_v + B_v >= floor, and with ||w_v|| <= max_v ||w_v||
        that needs y''_v + b |y''_v| >= floor - a ||x|| max ||w|| - flush, one threshold on y''_v a row (y + b |y|
        grows with y), rounded down to fp32. The few logits past it get their own B_v."""
        x = x.float()
        largest = x.abs().amax(dim=-1)
        usable = torch.isfinite(largest) & (largest > 0)
        exponent = torch.frexp(torch.where(usable, largest, torch.ones_like(largest))).exponent
        scale = torch.ldexp(torch.ones_like(largest), 1 - exponent)  # largest |x_i| * scale in [1, 2)
        xs = x * scale[:, None]
        ys = fixed_shape_linear(xs.to(torch.bfloat16), self.weight, BF16_ROW_CHUNK).float()
        a, b, flush = self.input_error, self.output_error, self.flush_error
        x_norm = xs.double().norm(dim=-1)
        top, top_col = ys.max(dim=-1)
        top = top.double()
        floor = top - (a * x_norm * self.row_norms[top_col] + b * top.abs() + flush)
        reach = floor - a * x_norm * self.max_row_norm - flush  # y + b |y| of any candidate is at least this
        threshold = torch.where(reach >= 0, reach / (1 + b), reach / (1 - b))
        low = threshold.float()
        low = torch.where(low.double() > threshold, torch.nextafter(low, torch.full_like(low, -float("inf"))), low)
        rows, cols = torch.nonzero(ys >= low[:, None], as_tuple=True)
        near = ys[rows, cols].double()
        keep = near + a * x_norm[rows] * self.row_norms[cols] + b * near.abs() + flush >= floor[rows]
        rows, cols = rows[keep], cols[keep]
        counts = torch.bincount(rows, minlength=x.shape[0])
        finite = torch.isfinite(floor) & torch.isfinite((top / scale).float())  # scaled back, it may overflow
        dense = torch.nonzero(~finite | (counts > DENSE_CANDIDATES), as_tuple=True)[0]
        if len(dense):  # their logits are computed whole instead
            chosen = ~torch.isin(rows, dense)
            rows, cols = rows[chosen], cols[chosen]
        return x, ys / scale[:, None], rows, cols, dense
