"""gemv_chain (ptx/gemv_chain.cu, SM90+): a decoder layer's one-row GEMVs after attention (o_proj + residual,
gate_up with its norm folded in and the SwiGLU, down + residual, then the next folded linear)
in one persistent launch, against the same ops launched one by one and against the CPU reference.

Bounds:
  - bit for bit equal to the same tail as separate gemv_tma launches (VOLTSERVE_GEMV_TMA=on, the chain off): every
    phase runs gemv_tma's products and fixed-order span sums, and the SwiGLU rounds as gemv_tma's SILU build does.
  - CHAIN_TOL = 8e-3 (max |got - ref| / max |ref|) against CpuBackend's fp32 composition: test_gemv_tma.py's 4e-3
    for one GEMV, here three GEMVs deep (each output of h2 or the next linear carries the fp16 roundings of h1 and
    of the SwiGLU, and the folded norms' fp16(W g)).
The grid and the ring do not change a bit (asserted), and every launch, whatever its grid, adds the same
arrivals to the grid barrier's counter (asserted after eager launches and graph replays).
"""

import pytest
import torch
from tests.kernels.kutils import assert_replay_equals_eager, backend_settings, launched_kernels, rel_err

from voltserve.backends.base import decoder_tail
from voltserve.backends.cuda import kernels_tma

pytestmark = pytest.mark.gpu
CHAIN_TOL = 8e-3
EPS = 1e-5


@pytest.fixture
def chain_backend(cuda_backend):
    """gemv_chain on (VOLTSERVE_GEMV_CHAIN=on) and gemv_tma on every weight it takes; SM90+ only."""
    if cuda_backend.loader.arch < 90:
        pytest.skip("gemv_chain needs cp.async.bulk (SM90+)")
    with backend_settings(cuda_backend, gemv_kernel="auto", gemv_tma="on", gemv_chain="on"):
        yield cuda_backend


def _assert_barrier_settled(backend):
    """Every launch, whatever its grid (a test shrinks it), adds kernels_tma.GEMV_CHAIN_BARRIER_QUANTUM arrivals."""
    assert int(backend.chain_barrier[0]) % kernels_tma.GEMV_CHAIN_BARRIER_QUANTUM == 0


def _layer(hidden, inter, then_out, seed):
    """CPU fp32 weights of one decoder tail and its inputs: o [1, hidden], h [1, hidden], the two norms."""
    gen = torch.Generator().manual_seed(seed)
    rand = lambda *s, scale=1.0: ((torch.randn(*s, generator=gen) * scale).half().float())  # noqa: E731
    return {"o_proj": rand(hidden, hidden, scale=0.03), "gate_up": rand(2 * inter, hidden, scale=0.03),
            "down": rand(hidden, inter, scale=0.03), "then": rand(then_out, hidden, scale=0.03),
            "post_norm": torch.rand(hidden, generator=gen) + 0.5, "then_norm": torch.rand(hidden, generator=gen) + 0.5,
            "o": rand(1, hidden), "h": rand(1, hidden, scale=2.0)}


def _prepared(backend, t):
    with backend_settings(backend, norm_fold="on"):
        return (backend.prepare_linear(t["o_proj"]),
                backend.prepare_linear(t["gate_up"], swiglu=True, norm=t["post_norm"]),
                backend.prepare_linear(t["down"]),
                backend.prepare_linear(t["then"], norm=t["then_norm"]))


def _tail(backend, t, weights, with_then=True):
    o_proj, gate_up, down, then = weights
    nt = (backend.prepare_norm(t["then_norm"]), then) if with_then else None
    with launched_kernels(backend) as names:
        h2, out = decoder_tail(backend, t["o"].half().cuda(), t["h"].half().cuda(), o_proj,
                               backend.prepare_norm(t["post_norm"]), gate_up, down, EPS, nt)
    return h2, out, names


# (hidden, intermediate, then's out_features): Llama-3-8B's layer with its qkv; a small layer whose last phase
# has fewer rows than SMs (blocks with no rows in a phase) and a down k of 3 spans
SHAPES = [(4096, 14336, 6144), (1024, 3072, 100)]


@pytest.mark.parametrize("shape", SHAPES)
def test_chain_equals_separate_launches_and_cpu(chain_backend, cpu_backend, shape):
    t = _layer(*shape, seed=sum(shape))
    weights = _prepared(chain_backend, t)
    h2, out, names = _tail(chain_backend, t, weights)
    assert names == ["gemv_chain"] and h2.shape == (1, shape[0]) and out.shape == (1, shape[2])
    _assert_barrier_settled(chain_backend)
    with backend_settings(chain_backend, gemv_chain="off"):
        h2_ref, out_ref, ref_names = _tail(chain_backend, t, weights)
    assert ref_names == ["gemv_tma"] * 4
    assert torch.equal(h2, h2_ref) and torch.equal(out, out_ref)
    cpu_h2, cpu_out = decoder_tail(cpu_backend, t["o"], t["h"], t["o_proj"], t["post_norm"], t["gate_up"], t["down"],
                                   EPS, (t["then_norm"], t["then"]))
    assert rel_err(h2, cpu_h2) <= CHAIN_TOL and rel_err(out, cpu_out) <= CHAIN_TOL


def test_three_phases_grid_and_ring(chain_backend):
    """Without `then` (3 phases); the same bits on 7 blocks with an 8 x 2 KB ring as on every SM with the default
    ring (the grid barrier and the ring's parities over a different number of stages per block)."""
    t = _layer(1024, 3072, 100, seed=7)
    weights = _prepared(chain_backend, t)
    h2, out, names = _tail(chain_backend, t, weights, with_then=False)
    assert names == ["gemv_chain"] and out is None
    with backend_settings(chain_backend, gemv_tma_ring=(8, 1), num_sms=7):
        small, _, small_names = _tail(chain_backend, t, weights, with_then=False)
    assert small_names == ["gemv_chain"] and torch.equal(small, h2)
    _assert_barrier_settled(chain_backend)


def test_not_taken_falls_back(chain_backend):
    """Two rows, or a weight without its norm folded where the chain folds one: the ops one by one."""
    t = _layer(1024, 3072, 100, seed=9)
    weights = list(_prepared(chain_backend, t))
    o, h = t["o"].half().cuda().repeat(2, 1), t["h"].half().cuda().repeat(2, 1)
    with launched_kernels(chain_backend) as names:
        h2, _ = decoder_tail(chain_backend, o, h, weights[0], chain_backend.prepare_norm(t["post_norm"]), weights[1],
                             weights[2], EPS, None)
    assert "gemv_chain" not in names and h2.shape == (2, 1024)
    weights[1] = chain_backend.prepare_linear(t["gate_up"], swiglu=True)  # not folded
    _, _, names = _tail(chain_backend, t, weights, with_then=False)
    assert "gemv_chain" not in names


def test_graph_replay_equals_eager(chain_backend):
    """Captured in a CUDA graph and replayed after new inputs: eager's bits, the barrier's counter zero after."""
    t = _layer(1024, 3072, 100, seed=11)
    o_proj, gate_up, down, then = _prepared(chain_backend, t)
    o, h = t["o"].half().cuda(), t["h"].half().cuda()
    post, then_norm = chain_backend.prepare_norm(t["post_norm"]), chain_backend.prepare_norm(t["then_norm"])

    def step():
        h2, out = decoder_tail(chain_backend, o, h, o_proj, post, gate_up, down, EPS, (then_norm, then))
        return [h2, out]

    def change():
        o.copy_(torch.randn_like(o))
        h.copy_(torch.randn_like(h))

    before = int(chain_backend.chain_barrier[0])
    assert_replay_equals_eager(chain_backend, step, change)
    # warm-up, eager and replay launches (capturing launches nothing)
    assert int(chain_backend.chain_barrier[0]) - before == 3 * kernels_tma.GEMV_CHAIN_BARRIER_QUANTUM
