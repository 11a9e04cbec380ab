"""Prototype, not part of the package: the wgmma forward kernel with TMA loads, mbarrier pipelines and
warp specialisation (one producer warpgroup whose warp 0 issues every TMA, 1-2 consumer
warpgroups of 64 rows each, setmaxnreg moving registers to the consumers). Softmax overlapped
with the previous block's P·V as in flashcore/kernels/wgmma.

Simplifications: non-causal, no LSE, S_k a multiple of tile_n (TMA zero-fills past the end, which
would need masking), fp16/bf16, (B, H, S, D) tensors, H_q == H_kv.

  python benchmarks/prototypes/tma_warp_specialised.py compile [m n stages d]  # CPU: PTX facts
  python benchmarks/prototypes/tma_warp_specialised.py run   # GPU (DSL installed): error, µs

It is launched by the DSL's own host code (which encodes the TMA descriptors at each call), not by
flashcore's runtime: measured on the H100 on 2026-11-23 to decide the Hopper family's next design
(benchmarks/results/tma-ws-prototype-h100-20261123.log, benchmarks/NOTES.md "Eighth session").
"""
import os
import sys

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90
from cutlass.cute.nvgpu import OperandMajorMode, cpasync, warpgroup

from flashcore.kernels.common.softmax import OnlineSoftmax
from flashcore.kernels.wgmma.attention_fwd import wgmma
from flashcore.kernels.wgmma.fragments import acc_as_operand_a, acc_mn_view

WG = 128


class WsAttention:
    def __init__(self, dtype, d, tm, tn, stages, producer_regs=24, consumer_regs=240):
        self.dtype, self.d, self.tm, self.tn, self.stages = dtype, d, tm, tn, stages
        self.consumers = tm // 64
        self.threads = WG * (self.consumers + 1)
        self.producer_regs = producer_regs
        self.consumer_regs = consumer_regs if self.consumers == 2 else 240

    def _layouts(self):
        d, tm, tn, st = self.d, self.tm, self.tn, self.stages
        atom = warpgroup.make_smem_layout_atom(warpgroup.SmemLayoutAtomKind.K_SW128, self.dtype)
        self.sQ_l = cute.tile_to_shape(atom, (tm, d), (0, 1))
        self.sKV_l = cute.tile_to_shape(atom, (tn, d, st), (0, 1, 2))
        self.qk_mma = sm90.make_trivial_tiled_mma(
            self.dtype, self.dtype, OperandMajorMode.K, OperandMajorMode.K, cutlass.Float32,
            (self.consumers, 1, 1), (64, tn))
        self.pv_mma = sm90.make_trivial_tiled_mma(
            self.dtype, self.dtype, OperandMajorMode.K, OperandMajorMode.MN, cutlass.Float32,
            (self.consumers, 1, 1), (64, d), sm90.OperandSource.RMEM)
        dtype, n_q, n_kv = self.dtype, cute.cosize(self.sQ_l), cute.cosize(self.sKV_l)
        Align, Mem = cute.struct.Align, cute.struct.MemRange

        @cute.struct
        class Storage:
            mbar_q: Mem[cutlass.Int64, 2]
            mbar_k: Mem[cutlass.Int64, 2 * st]
            mbar_v: Mem[cutlass.Int64, 2 * st]
            sQ: Align[Mem[dtype, n_q], 1024]
            sK: Align[Mem[dtype, n_kv], 1024]
            sV: Align[Mem[dtype, n_kv], 1024]

        self.Storage = Storage
        self.q_bytes = tm * d * dtype.width // 8
        self.kv_bytes = tn * d * dtype.width // 8

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor,
                 scale_log2: cutlass.Float32):
        self._layouts()
        op = cpasync.CopyBulkTensorTileG2SOp()

        def sdhb(t):  # (B, H, S, D) -> (S, D, H, B): the row index first, D contiguous
            return cute.make_tensor(t.iterator, cute.select(t.layout, mode=[2, 3, 1, 0]))

        atom_q, tma_q = cpasync.make_tiled_tma_atom(op, sdhb(mQ), self.sQ_l, (self.tm, self.d))
        kv_stage = cute.select(self.sKV_l, mode=[0, 1])
        atom_k, tma_k = cpasync.make_tiled_tma_atom(op, sdhb(mK), kv_stage, (self.tn, self.d))
        atom_v, tma_v = cpasync.make_tiled_tma_atom(op, sdhb(mV), kv_stage, (self.tn, self.d))
        grid = (cute.ceil_div(mQ.shape[2], self.tm), mQ.shape[1], mQ.shape[0])
        self.kernel(atom_q, tma_q, atom_k, tma_k, atom_v, tma_v, mO, scale_log2,
                    mK.shape[2]).launch(grid=grid, block=[self.threads, 1, 1],
                                        smem=self.Storage.size_in_bytes())

    @cute.kernel
    def kernel(self, atom_q: cute.CopyAtom, tma_q: cute.Tensor, atom_k: cute.CopyAtom,
               tma_k: cute.Tensor, atom_v: cute.CopyAtom, tma_v: cute.Tensor, mO: cute.Tensor,
               scale_log2: cutlass.Float32, seqlen_k: cutlass.Int32):
        self._layouts()  # trace-time values of the kernel's own region
        m_block, head, batch = cute.arch.block_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tidx, _, _ = cute.arch.thread_idx()
        if warp == 0:
            for a in (atom_q, atom_k, atom_v):
                cpasync.prefetch_descriptor(a)
        storage = cutlass.memory.SmemAllocator().allocate(self.Storage)
        thread = pipeline.CooperativeGroup(pipeline.Agent.Thread, 1)
        consumer_warps = pipeline.CooperativeGroup(pipeline.Agent.Thread, 4 * self.consumers)
        pipe_q = pipeline.PipelineTmaAsync.create(
            num_stages=1, producer_group=thread, consumer_group=consumer_warps,
            tx_count=self.q_bytes, barrier_storage=storage.mbar_q.data_ptr(), defer_sync=True)
        pipe_k = pipeline.PipelineTmaAsync.create(
            num_stages=self.stages, producer_group=thread, consumer_group=consumer_warps,
            tx_count=self.kv_bytes, barrier_storage=storage.mbar_k.data_ptr(), defer_sync=True)
        pipe_v = pipeline.PipelineTmaAsync.create(
            num_stages=self.stages, producer_group=thread, consumer_group=consumer_warps,
            tx_count=self.kv_bytes, barrier_storage=storage.mbar_v.data_ptr(), defer_sync=True)
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()

        sQ = storage.sQ.get_tensor(self.sQ_l.outer, swizzle=self.sQ_l.inner)
        sK = storage.sK.get_tensor(self.sKV_l.outer, swizzle=self.sKV_l.inner)
        sV = storage.sV.get_tensor(self.sKV_l.outer, swizzle=self.sKV_l.inner)
        n_blocks = cute.ceil_div(seqlen_k, self.tn)

        if warp < 4:  # the producer warpgroup: warp 0 issues every TMA
            cute.arch.setmaxregister_decrease(self.producer_regs)
            if warp == 0:
                gQ = cute.local_tile(tma_q[None, None, head, batch], (self.tm, self.d),
                                     (m_block, 0))
                gK = cute.local_tile(tma_k[None, None, head, batch], (self.tn, self.d),
                                     (None, 0))
                gV = cute.local_tile(tma_v[None, None, head, batch], (self.tn, self.d),
                                     (None, 0))
                sQg, gQg = cpasync.tma_partition(atom_q, 0, cute.make_layout(1),
                                                 cute.group_modes(sQ, 0, 2),
                                                 cute.group_modes(gQ, 0, 2))
                sKg, gKg = cpasync.tma_partition(atom_k, 0, cute.make_layout(1),
                                                 cute.group_modes(sK, 0, 2),
                                                 cute.group_modes(gK, 0, 2))
                sVg, gVg = cpasync.tma_partition(atom_v, 0, cute.make_layout(1),
                                                 cute.group_modes(sV, 0, 2),
                                                 cute.group_modes(gV, 0, 2))
                qs = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
                pipe_q.producer_acquire(qs)
                cute.copy(atom_q, gQg, sQg, tma_bar_ptr=pipe_q.producer_get_barrier(qs))
                ps = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer,
                                                  self.stages)
                for i in range(n_blocks):
                    n = n_blocks - 1 - i
                    pipe_k.producer_acquire(ps)
                    cute.copy(atom_k, gKg[None, n], sKg[None, ps.index],
                              tma_bar_ptr=pipe_k.producer_get_barrier(ps))
                    pipe_v.producer_acquire(ps)
                    cute.copy(atom_v, gVg[None, n], sVg[None, ps.index],
                              tma_bar_ptr=pipe_v.producer_get_barrier(ps))
                    ps.advance()
        else:
            cute.arch.setmaxregister_increase(self.consumer_regs)
            self.consume(sQ, sK, sV, mO, pipe_q, pipe_k, pipe_v, scale_log2, n_blocks,
                         tidx - WG, m_block, head, batch)

    @cute.jit
    def consume(self, sQ, sK, sV, mO, pipe_q, pipe_k, pipe_v, scale_log2, n_blocks, ctid,
                m_block, head, batch):
        d, tm, tn, st = self.d, self.tm, self.tn, self.stages
        wg = cute.arch.make_warp_uniform(ctid // WG)
        sVt = cute.composition(sV, cute.make_ordered_layout((d, tn, st), order=(1, 0, 2)))
        wg_qk = self.qk_mma.get_slice(wg * WG)
        wg_pv = self.pv_mma.get_slice(wg * WG)
        tSrQ = wg_qk.make_fragment_A(wg_qk.partition_A(sQ))
        tSrK = wg_qk.make_fragment_B(wg_qk.partition_B(sK))
        tOrVt = wg_pv.make_fragment_B(wg_pv.partition_B(sVt))
        thr_qk = self.qk_mma.get_slice(ctid)
        thr_pv = self.pv_mma.get_slice(ctid)
        acc_O = cute.make_rmem_tensor(thr_pv.partition_shape_C((tm, d)), cutlass.Float32)
        acc_O.fill(0.0)
        softmax = OnlineSoftmax(cute.size(acc_mn_view(acc_O), mode=[0]), scale_log2,
                                form="offset")
        rP = cute.make_rmem_tensor(thr_qk.partition_shape_C((tm, tn)), self.dtype)

        qs = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
        pipe_q.consumer_wait(qs)
        ks = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, st)
        # step 0: S_0, P_0
        pipe_k.consumer_wait(ks)
        acc_S = cute.make_rmem_tensor(thr_qk.partition_shape_C((tm, tn)), cutlass.Float32)
        wgmma(self.qk_mma, acc_S, tSrQ, tSrK[None, None, None, ks.index], zero_init=True,
              wait=0)
        pipe_k.consumer_release(ks)
        softmax.rescale(acc_mn_view(acc_O), softmax.step(acc_mn_view(acc_S)))
        rP.store(acc_S.load().to(self.dtype))
        for _ in range(1, n_blocks):
            ks = self.overlapped_step(ks, pipe_k, pipe_v, thr_qk, tSrQ, tSrK, tOrVt, acc_O, rP,
                                      softmax)
        pipe_v.consumer_wait(ks)
        tOrP = cute.make_tensor(rP.iterator, acc_as_operand_a(rP.layout))
        wgmma(self.pv_mma, acc_O, tOrP, tOrVt[None, None, None, ks.index], zero_init=False,
              wait=0)
        pipe_v.consumer_release(ks)
        softmax.finish()
        O = acc_mn_view(acc_O)
        for r in cutlass.range_constexpr(cute.size(O, mode=[0])):
            O[r, None] = O[r, None].load() * softmax.inverse_sum(r)
        # epilogue (prototype): straight from the accumulator, 4-byte stores, rows < S_q
        rO = cute.make_rmem_tensor(acc_O.layout, self.dtype)
        rO.store(acc_O.load().to(self.dtype))
        gO = cute.local_tile(mO[batch, head, None, None], (tm, d), (m_block, 0))
        cO = cute.local_tile(cute.make_identity_tensor((mO.shape[2], d)), (tm, d),
                             (m_block, 0))
        tOgO, tOcO = thr_pv.partition_C(gO), thr_pv.partition_C(cO)
        for i in cutlass.range_constexpr(cute.size(rO)):
            if cute.elem_less(tOcO[i][0], mO.shape[2]):
                tOgO[i] = rO[i]


    @cute.jit
    def overlapped_step(self, ks, pipe_k, pipe_v, thr_qk, tSrQ, tSrK, tOrVt, acc_O, rP, softmax):
        vs = ks.clone()
        ks.advance()
        pipe_k.consumer_wait(ks)
        acc_S = cute.make_rmem_tensor(thr_qk.partition_shape_C((self.tm, self.tn)),
                                      cutlass.Float32)
        wgmma(self.qk_mma, acc_S, tSrQ, tSrK[None, None, None, ks.index], zero_init=True,
              wait=None)
        pipe_v.consumer_wait(vs)
        tOrP = cute.make_tensor(rP.iterator, acc_as_operand_a(rP.layout))
        wgmma(self.pv_mma, acc_O, tOrP, tOrVt[None, None, None, vs.index], zero_init=False,
              wait=None)
        warpgroup.wait_group(1)
        pipe_k.consumer_release(ks)
        correction = softmax.step(acc_mn_view(acc_S))
        warpgroup.wait_group(0)
        pipe_v.consumer_release(vs)
        softmax.rescale(acc_mn_view(acc_O), correction)
        rP.store(acc_S.load().to(self.dtype))
        return ks


def compile_only(m=128, n=128, stages=2, d=128):
    from cutlass.cute.runtime import make_fake_tensor

    dt = cutlass.Float16

    def bhsd():
        s = cute.sym_int32()
        return make_fake_tensor(dt, (cute.sym_int32(), cute.sym_int32(), s, d),
                                tuple(cute.sym_int64(divisibility=8) for _ in range(3)) + (1,),
                                assumed_align=16)

    return cute.compile(WsAttention(dt, d, m, n, stages), bhsd(), bhsd(), bhsd(), bhsd(),
                        cutlass.Float32(1.0), options="--keep-ptx --keep-cubin")


def compile_report(args) -> None:
    """What the PTX holds (TMA, mbarrier waits, setmaxnreg, wgmma) and ptxas's resources."""
    import re
    import subprocess
    import tempfile

    ptx = compile_only(*args).__ptx__
    body = ptx[ptx.index(".entry"):]
    for k in ("cp.async.bulk.tensor", "mbarrier.try_wait", "setmaxnreg", "wgmma.mma_async",
              "bar.sync", "cp.async.cg"):
        print(f"{k:24s}", body.count(k))
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        out = subprocess.run(["ptxas", "-arch=sm_90a", "-v", src, "-o", src + ".cubin"],
                             check=False, capture_output=True, text=True)
    print("\n".join(line for line in (out.stdout + out.stderr).splitlines()
                    if re.search(r"registers|spill|stack|warn|serial", line, re.IGNORECASE)))


def _median_us(fn, reps: int = 20) -> float:
    """CUDA-event median of back-to-back launches on the default stream (the DSL's launcher)."""
    import torch

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    return sorted(times)[len(times) // 2]


def run() -> None:
    """Max-abs error against SDPA (poisoned outputs) and µs against flashcore's tuned default
    and SDPA's default backend, one process."""
    import json
    import math

    import torch
    from cutlass.cute.runtime import from_dlpack

    from flashcore.ops import attention

    def arg(t):
        return from_dlpack(t, assumed_align=16).mark_layout_dynamic(leading_dim=3)

    configs = [(128, 128, 2), (128, 64, 2), (128, 128, 3), (64, 64, 2)]
    compiled = {}
    for b, h, s, d in [(4, 16, 4096, 128), (2, 16, 8192, 128), (4, 16, 4096, 64)]:
        q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=torch.float16)
                   for _ in range(3))
        scale_log2 = cutlass.Float32(math.log2(math.e) / math.sqrt(d))
        ref = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        work = 4 * b * h * s * s * d

        def report(impl, us, shape=(b, h, s, d), work=work, **extra):
            print(json.dumps({"shape": list(shape), "impl": impl, **extra, "us": round(us, 1),
                              "tflops": round(work / us / 1e6, 1)}), flush=True)

        report("flashcore tile=None", _median_us(lambda q=q, k=k, v=v: attention(q, k, v)))
        for m, n, st in configs:
            if (m, n, st, d) == (128, 128, 3, 128):
                continue  # 224 KB of tiles and the barriers: over the 227 KB budget
            o = torch.full_like(q, float("nan"))
            key = (m, n, st, d)
            if key not in compiled:
                compiled[key] = cute.compile(WsAttention(cutlass.Float16, d, m, n, st),
                                             arg(q), arg(k), arg(v), arg(o), scale_log2)

            def launch(f=compiled[key], q=q, k=k, v=v, o=o, scale_log2=scale_log2):
                f(arg(q), arg(k), arg(v), arg(o), scale_log2)

            launch()
            torch.cuda.synchronize()
            report(f"ws m{m}n{n}s{st}", _median_us(launch),
                   err=(o.float() - ref.float()).abs().max().item(),
                   finite=bool(torch.isfinite(o).all()))
        report("sdpa default (cudnn/flash)", _median_us(
            lambda q=q, k=k, v=v: torch.nn.functional.scaled_dot_product_attention(q, k, v)))


if __name__ == "__main__":
    if sys.argv[1] == "compile":
        compile_report([int(x) for x in sys.argv[2:]] or [128, 128, 2, 128])
    else:
        run()
