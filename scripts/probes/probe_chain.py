"""Probe: cost of a dependency between two decode ops, as a PDL kernel boundary vs a counter
spin inside one launch. Measurement probe (session 11, GPU only; results in
docs/bench/h100-session11-probes.txt): PYTHONPATH=. python scripts/probes/probe_chain.py"""

import torch
import triton
import triton.language as tl

from graph_timing import replay_ms

CHUNK = 256


@triton.jit
def _weight_slice_sum(w, index, W_ELEMS: tl.constexpr):
    """The work item's weight slice (read before any wait, as a GEMV reads its first tile)."""
    if W_ELEMS > 0:
        wv = tl.load(w + index.to(tl.int64) * W_ELEMS + tl.arange(0, W_ELEMS))
        return tl.sum(wv.to(tl.float32), axis=0)
    return 0.0


@triton.jit
def _pdl_step(src, dst, w, W_ELEMS: tl.constexpr, CHUNK: tl.constexpr, PDL: tl.constexpr):
    pid = tl.program_id(0)
    offs = tl.arange(0, CHUNK)
    extra = _weight_slice_sum(w, pid, W_ELEMS)
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    x = tl.load(src + offs)
    tl.store(dst + pid * CHUNK + offs, x * 0.5 + extra * 1e-9 + 1.0)


@triton.jit
def _chain(buf, w, ticket, done, G, W_ELEMS: tl.constexpr, CHUNK: tl.constexpr, STRIDE):
    role = tl.atomic_add(ticket, 1, sem="relaxed", scope="gpu")
    s = role // G
    j = role % G
    offs = tl.arange(0, CHUNK)
    extra = _weight_slice_sum(w, role, W_ELEMS)
    if s > 0:
        c = tl.atomic_add(done + s - 1, 0, sem="acquire", scope="gpu")
        while c < G:
            c = tl.atomic_add(done + s - 1, 0, sem="acquire", scope="gpu")
    x = tl.load(buf + s.to(tl.int64) * STRIDE + offs)
    tl.store(buf + (s + 1).to(tl.int64) * STRIDE + j * CHUNK + offs, x * 0.5 + extra * 1e-9 + 1.0)
    tl.debug_barrier()
    tl.atomic_add(done + s, 1, sem="release", scope="gpu")


def main():
    N = 48
    for G, W in ((32, 0), (14, 0), (224, 0), (224, 4096), (2432, 0), (2432, 4096), (304, 16384)):
        warps = 4
        bufs = [torch.zeros(max(G * CHUNK, CHUNK), device="cuda") for _ in range(N + 1)]
        w = torch.randn(N * G * max(W, 1), device="cuda", dtype=torch.bfloat16) if W else bufs[0]

        def pdl_chain(pdl):
            def run():
                for s in range(N):
                    ws = w[s * G * W:] if W else w
                    kw = {"launch_pdl": True} if pdl else {}
                    _pdl_step[(G,)](bufs[s], bufs[s + 1], ws, W_ELEMS=W, CHUNK=CHUNK, PDL=pdl,
                                    num_warps=warps, **kw)
            return run

        big = torch.zeros((N + 1) * G * CHUNK, device="cuda")
        counters = torch.zeros(N + 1, dtype=torch.int32, device="cuda")

        def chain():
            counters.zero_()
            _chain[(N * G,)](big, w, counters[N:], counters, G, W_ELEMS=W, CHUNK=CHUNK,
                             STRIDE=G * CHUNK, num_warps=warps)

        t_plain = replay_ms(pdl_chain(False), 200) * 1e3 / N
        t_pdl = replay_ms(pdl_chain(True), 200) * 1e3 / N
        t_chain = replay_ms(chain, 200) * 1e3 / N
        # check the chain's result equals the launches' result
        pdl_chain(True)()
        chain()
        torch.cuda.synchronize()
        ok = torch.allclose(big[N * G * CHUNK:].view(G, CHUNK), bufs[N].view(G, CHUNK))
        mb = G * W * 2 / 1e6
        print(f"G={G:5d} weight/step {mb:6.2f} MB: us per step  plain {t_plain:6.2f}  "
              f"pdl {t_pdl:6.2f}  counter-chain {t_chain:6.2f}  same result {ok}", flush=True)


if __name__ == "__main__":
    main()
