// w4a4_gemm (sm_90a): the warp-specialized persistent W4A4 GEMM with the fused low-rank branch.
// Byte contract: docs/layouts.md, section w4a4_gemm; the weights are prepacked (formats/svdq_layout.py).
// Kernels: W4A4GemmKernel, and for long prefills ExpandWeightsKernel before it (expanded weights, below).
//
//   Y[m,n] = α[n] Σ_g s_x[m,g(k)] s_w[n,g] Σ_{k∈g} x[m,k] q_w[n,k]  +  Σ_j half(LA[m,j]) L_up[j,n]  +  β[n]
//
// Orientation (A/B swap). A CTA computes a tile of Yᵀ: kTileN = 128 output columns (the wgmma M side,
// 64 per consumer warpgroup) x kTileM tokens (the wgmma N side: 8, 16, 32, 64 or 128, picked by M, so
// decode and prefill run the same kernel; on expanded weights 128 or 256: W4A4LaunchShapeIndex). Below
// kW4A4ExpandedWeightsMinTokens tokens the int4 weights are the A operand FROM REGISTERS: each consumer
// thread loads its fragments of a group of 64 with one 16-byte LDS (the prepacked layout), converts
// int4 -> e4m3 in registers and issues dense wgmma m64nNk32 .e4m3.e4m3. The activations (e4m3 codes for
// every act_format) are the B operand in shared memory, loaded by TMA with the 128-byte swizzle, K-major.
// Two conversions, picked by the token tile (W4A4OffsetWeights):
//   prefill (64, 128 tokens): exact, a prmt table lookup (q in [-8, 7] is exact in e4m3), 11 instructions
//     per 8 weights; the tensor cores are the bound there, so no extra wgmma (session 16, 8192^3: offset codes
//     with the correction wgmmas 1.71 -> 1.89-1.93 ms; without any correction, wrong numbers, 1.43).
//   decode (8, 16, 32 tokens; issue-bound): offset codes, the byte u = q + 8 in [0, 15], which read as e4m3
//     is exactly u·2^-9 (mask, shift, 2 prmt: 5 instructions per 8 weights), so a unit's partial is
//     2^-9 Σ x (q + 8). The promotion cancels the offset with the token's promotion record (s_x, c) of the
//     group, c = -2^-6 S s_x with S = Σ_k x its code sum (W4A4PromotionRecordsBytes: written by act_quant in
//     the W4A4 linear, else by PromotionRecordsKernel before the GEMM): acc = fma(fma(partial, s_x, c), s_w,
//     acc), where partial·s_x + c = s_x·2^-9 Σ x q is rounded once, as partial·s_x was when a correction wgmma
//     per k32 wgmma (A = -8·2^-9) formed 2^-9 Σ x q on the tensor cores (until session 48: 4.4% of
//     16 x 28672 x 8192, 6.4% at 32 tokens). 2^9 is applied with α. Same for int4, uint4 and fp8 activations.
// Expanded weights (long prefills, from kW4A4ExpandedWeightsMinTokens tokens, the last two instances: the 128- and
//   256-token tiles): ExpandWeightsKernel first writes the whole weight matrix as e4m3 codes, (n, k) row-major, into
//   the workspace (with the prefill table above: exact), and the GEMM's TMA loads 16 KB stages of it with
//   the 128-byte swizzle; the consumers read their A fragments from the stage with ldmatrix, no conversion
//   (ExpandedFragments). Session 19: 8192^3 1708-1718 -> 1397 us, the pass included (w4a4_gemm_plan.h).
//   The 256-token tile streams half the weight and multicast token bytes per MMA that the 128-token tile does
//   (8192^3 1398-1403 -> 1328-1337 us, session 53); its 128 accumulator registers leave it one partial and one
//   product set (below), 16-rank low-rank chunks and an epilogue that stores 128 tokens at a time.
//
// Persistent tile scheduler. grid = min(co-resident clusters, cluster tiles) x cluster CTAs; cluster
// tile c covers one token tile and `kCluster` adjacent column tiles; CTAs walk the cluster tiles in a
// static strided order (c += #clusters), rasterized in groups of kRasterGroup token tiles so the CTAs
// running at the same time share weight tiles and token tiles in L2. Every role walks the same order.
// Stream-K (decode tiles, cluster 1, when the tiles do not divide over the CTAs: W4A4UsesStreamK in the
// plan header): the grid is every resident CTA and CTA b runs the iterations [b T / G, (b + 1) T / G) of
// the T = tiles x k-stages, as segments (tile, k-stage range). The segment holding a tile's first k-stage
// finishes it (low-rank, α/β, epilogue: only these segments have low-rank items); a segment that starts
// inside a tile (only the first of a range) stores its fp32 accumulators in its CTA's workspace slot and
// sets a flag (st.release.gpu); the finisher waits for the flags of the later CTAs of its tile
// (ld.acquire.gpu), sets them back to 0 (common/arrival_counters.h: the flags are the library's own
// counters, which every launch leaves zeroed, so there is no memset) and adds their slots in CTA order, so
// the result is deterministic. Those CTAs run that segment first and never wait, so every wait ends (all
// CTAs are resident: the grid is the occupancy).
//
// Warp roles (384 threads = 3 warpgroups; setmaxnreg moves registers to the MMA warps):
//   warpgroup 0, producers, setmaxnreg.dec 40:
//     warp 0    main pipeline: TMA of the weight tile (L2 evict-first when there is one token tile: each
//               weight is read once), one bulk copy of its stage-major weight scales (512 contiguous bytes,
//               formats/svdq_layout.py), TMA of its half of the token tile (multicast); the tokens' promotion
//               records (16 bytes per token and stage) by TMA on the 32-token tile and by cp.async on the 8-
//               and 16-token tiles (Config::kRecordsByTma); prefill tiles: cp.async of the activation-scale
//               words (4 bytes per token and stage in act_quant's layout: TMA boxes need 16-byte rows, so
//               they go through cp.async with mbarrier completion). The W4A4 linear
//               (ffi/w4a4_linear_ffi.cc) launches this kernel with programmatic dependent launch while
//               act_quant, which writes the tokens, still runs: the warp waits for act_quant's CTAs to
//               arrive at the token-ready counter before its first copy (WaitForTokens)
//     warp 1    low-rank pipeline: TMA of the L_up chunk, its half of the LA chunk (multicast), α/β; it
//               waits for act_quant's end (griddepcontrol.wait) first: LA is its split sum's result; in the
//               linear it then re-arms the token-ready counter (RearmTokens)
//     warps 2-3 convert the LA chunk fp32 -> output dtype into the swizzled wgmma B buffer
//   warpgroups 1-2, consumers, setmaxnreg.inc 232 (96 with two CTAs per SM: ConsumerRegisters): 64
//     output columns each; the main loop, α, the
//     low-rank wgmmas, and the epilogue (+β, stmatrix into the swizzled staging tile, TMA store).
//
// Three pipelines, each with its own mbarriers and one explicit PipeState {index, phase} per role,
// advanced explicitly; no full-CTA barrier joins them (named barriers are per consumer warpgroup):
//   main      kStages x [weights int4 8 KB (expanded: e4m3 16 KB) | weight scales | activations e4m3 |
//             activation scales]
//   low-rank  kLoraStages x [L_up chunk | LA chunk fp32 | LA chunk in the MMA dtype | α, β] per chunk of
//             kLoraChunk ranks (a tile has max(1, ceil(rank / kLoraChunk)) items; item 0 carries α/β)
//   epilogue  one staging tile of up to 128 tokens per consumer warpgroup; its TMA store is awaited (bulk
//             wait_group.read) before the next tokens are staged.
//
// Consumer -> producer releases of a peer CTA's stage are mbarrier.arrive.shared::cluster with the default
// (.release.cta) semantics: the consumer only read the stage. With .release.cluster ptxas emitted MEMBAR.ALL.GPU
// before every remote arrive (56K of the kernel's 359K stall samples; 3.20 -> 2.37 ms at 8192^3 without it).
// Cluster of 2 CTAs along N (the 128-token tile): the token operand (activations, LA) is
// shared; each CTA issues half of the rows with .multicast::cluster into both CTAs' shared memory, so
// every CTA holds the whole tile and every CTA's full barrier expects the whole tile's bytes
// (W4A4Plan: footprint replicated, issue split, barrier expects all; static_asserts below). A consumer
// warp releases a main stage on the empty barrier of every CTA of the cluster (the peer multicasts into
// it); the converter warps release the LA buffer the same way. Activation scales are loaded by each
// CTA itself (cp.async, 4 bytes per token): their footprint is the plan's, their issue is not split.
// (Decode tiles, whose promotion records may come by TMA, run without clusters.)
//
// Main loop of a consumer warpgroup, per stage (2 groups of 64 k) and per slice of <= 64 tokens:
//   unit (slice, group): two wgmma k32 into the fresh partial set part[group] (scale-d = 0 on the
//   first), commit; wgmma.wait_group(1) retires the
//   previous unit, which is then promoted: acc = fma(part · s_x[m], s_w[n], acc). So each promotion
//   overlaps the next unit's wgmmas (two partial sets, wait_group(1)); the stage's last unit is promoted
//   after wait_group(0), then the stage is released (the other consumer warpgroup's wgmmas fill the
//   tensor cores meanwhile). Carrying that unit across the K loop's back edge would make ptxas serialize
//   every wgmma (C7514: accumulators of a wgmma in flight across the back edge are read). 128 tokens run
//   as 2 slices of n64 (acc 64 + 2 x 32 partial registers) instead of n128 (64 + 2 x 64: too many for
//   232 registers). 256 tokens run as 4 slices of n64 with one partial set (acc 128 + 32, + 32 of products):
//   each unit is promoted once it retires (wait_group(0)), while the other warpgroup's units run.
// Scale products (W4A4ScaleProductMma: the 32-, 64- and 128-token tiles with 16-bit activation scales): after a
//   unit's two k32 wgmmas, one wgmma m64nNk16 bf16/fp16 forms s_w[n]·s_x[m] for the whole unit on the tensor
//   cores (A from registers: the thread's two weight-scale words masked to group gi's half, at k = gi, in the
//   lanes that hold k = 0, 1; B = the stage's activation-scale buffer, a 16-byte row per token whose first
//   4 bytes are the cp.async'ed scale word and whose rest was zeroed at kernel start; 16-bit products are
//   exact in fp32), so the promotion is acc = fma(part, product, acc): one FFMA per element, no scale loads
//   or decodes (measured 2.11 -> 1.85 ms at 8192^3, instructions -30%). The tensor cores do 1.5x the work.
//   One product set per partial set: a unit's products are issued with its partial, part(u) + products(u),
//   wait(1), promote(u - 1) (session 14: 8192^3 1.78 -> 1.72 ms, 64 x 28672 x 8192 81.4 -> 80.2 us; with one
//   set, issued after the previous promotion had read it, the products' latency was on every unit's chain).
//   The registers of the 128-token tile's second set come from acc not being a wgmma operand (with scale
//   products the low-rank wgmmas run into a partial set, which is then added, below). The consumers fence
//   the async proxy after each full barrier (cp.async wrote the scales).
// After the K loop: acc *= α (α scales the main product only; decode: α·2^9, exact); the low-rank up
// projection runs as wgmma m64nNk16 bf16/fp16 (A = L_upᵀ chunk from shared memory, MN-major; B = the
// converted LA chunk) into the fp32 accumulators (tiles with scale products: into a fresh partial set, then
// added, one FADD per element and chunk), every k-step of the chunk (ranks past `rank` are zero-filled in
// both operands; a runtime trip count puts descriptor arithmetic between wgmmas and ptxas then serializes
// every wgmma of the kernel); the epilogue adds β.
// SASS check (cuobjdump -sass): per unit WARPGROUP.ARRIVE and QGMMA x2 (decode: x4, register A and
// shared-memory A alternating), DEPBAR.LE gsb0 n as the units retire, DEPBAR 0 at the step end; the
// low-rank HGMMAs chained; no local memory; no "wgmma serialized" ptxas warning.
//
// Life of main stage s (phase bit ph = number of completed uses of s, mod 2):
//   producer warp 0: wait empty[s] (parity ph^1: the previous use is released; a fresh barrier passes);
//     lane 0: arrive.expect_tx(full[s], weights + weight scales + whole token tile [+ 32 tokens: records])
//     [arrival 1 of 33; 32 tokens: of 1], TMA weights, bulk copy of the weight scales, TMA its token half
//     (multicast) [32 tokens: TMA of the records]; other tiles: lanes 0-31 cp.async the records or scale
//     words, then cp.async.mbarrier.arrive.noinc(full[s]) [arrivals 2..33, each when the lane's copies landed].
//   full[s] (count 33, 32 tokens 1; + tx bytes): completes phase ph when the arrivals and all the bytes (own
//     and the peer's multicast half) are in. The peer's bytes may land before our expect_tx: the
//     tx-count goes transiently negative, which the mbarrier allows; the phase cannot complete while
//     our arrivals are missing.
//   consumers (both warpgroups): wait full[s] (parity ph); LDS weights and scales, wgmma on the tokens;
//     after the stage's last unit is retired (wait_group) and promoted, each of the 8 consumer warps
//     arrives once on empty[s] of every CTA of the cluster (__syncwarp, then one lane per CTA). racecheck
//     reports the lanes' scale loads against the stage's next copies as hazards: it does not carry a lane's
//     load through __syncwarp to another lane's arrive (benchmarks/racecheck_probe.cu, session 46).
//   empty[s] (count 8 x kCluster): completes phase ph when both CTAs' consumers are done with s; only
//     then may either CTA's producer write s again (its own copy or, by multicast, the peer's).
// Life of low-rank stage s: warp 1 waits lr_empty[s] (parity ph^1), arrive.expect_tx(lr_full[s]) [count
//   1], TMA L_up chunk, its LA half (multicast), α/β (bulk copies; item 0 only). Converter warps wait
//   lr_full[s], write the converted LA chunk, fence.proxy.async, then lane 0 of each warp arrives on
//   lr_conv[s] [count 2] and on lr_empty[s] of every CTA (the LA buffer is free). Consumers wait
//   lr_full[s] and lr_conv[s], run the chunk's wgmmas, wait_group(0), each warp arrives on lr_empty[s]
//   [count 8 + 2 x kCluster]. The converted buffer is rewritten only after lr_full[s] of its next use,
//   which needs lr_empty[s], which needs these consumers: no separate barrier.
// M tails: TMA zero-fills out-of-bounds token rows; a token half that lies wholly past M is not issued
// and not expected (both CTAs compute the same count), its rows hold stale data that only reaches
// output rows the TMA store clips. An odd number of column tiles leaves the cluster's last CTA a
// phantom tile: it issues its token half for the peer, skips its private loads, and stores nothing.
//
// Shared memory (W4A4Plan, python -m jax_w4a4.budget; static_assert'ed here, + 1 KB to align the base;
// every tile keeps a 16-byte activation-scale record per token and stage, kW4A4ActScalePitch):
//   tokens  cluster  CTAs/SM  main stages  low-rank stages  total
//      8       1        2          7             2          112256 B
//     16       1        2          7             1          104960 B
//     32       1        1          8             2          174336 B
//     64       1        1          7             2          226048 B
//    128       2        1          6             1          229504 B   (of 231424: 227 KB less the slack)
//    128       2        1          3             2          206464 B   (expanded weights: 16 KB stages)
//    256       2        1          3             1          223872 B   (expanded; 16-rank chunks, 128-token staging)
// Two CTAs per SM (8- and 16-token tiles, W4A4CtasPerSm): each plan is solved against half the SM
// (114688 B with the slack and the driver's 1 KB), registers 80 per thread at launch, so setmaxnreg
// moves 40 -> producers and 96 -> consumers inside each CTA's pool of 384 x 80.
//
// Estimate (per CTA of 128 columns x 128 tokens, per group of 64 k, H200 at ~1.83 GHz):
//   tensor:     128 x 128 x 64 x 2 = 2.1 MFLOP = 256 clk at 8192 fp8 flop/clk/SM (1979 TFLOPS dense).
//   promotion:  2 FP32 ops x 16384 outputs = 32768 thread-instructions = 256 issue clk of the 4
//               schedulers: the issue slots are nearly full with promotion alone.
//   conversion: 11 instructions per 8 weights (3 prmt per 4 values + mask/shift) = 1.4 / value:
//               8192 values = 88 clk (14 in the SASS: __byte_perm masks its selectors; + copies of the
//               prmt tables at 232 registers). Activation scales: 1 LDS.64 per 2 tokens + 1 decode per token
//               (16-bit) = 96 clk (int4/uint4), 32 clk (fp8). wgmma, barriers, s_w: ~20 clk.
//   => issue-bound at ~460 clk per 256 clk of MMA: <= ~56% of the fp8 peak (~1100 TFLOPS) for
//      int4/uint4 activations, ~65% (~1280) for fp8, before latency and memory effects. The floor
//      asked for is 1023 (1.3x cuBLAS bf16 at 8192^3 with rank 32).
//   With the scale-product wgmma (int4/uint4): promotion 128 clk, no activation-scale work, tensor 384 clk:
//      ~250 issue clk per 384 clk of MMA. Measured (session 5, ncu): 1.85 ms = 594 TFLOPS at 8192^3, issue
//      slots 52% busy, tensor ~45%: neither is full; the consumers wait on their own chain (wgmma
//      completion 10% of stall samples, wgmma issue 15%, fixed-latency dependencies 13%) with two
//      consumer warps per scheduler. Session 14: 1.71-1.73 ms (641 TFLOPS at the JAX level) with a product
//      set per partial set; the time follows each warpgroup's wgmma chain, not its instruction count (a
//      build with 1/16 of the promotions ran slower; benchmarks/NOTES.md).
//   decode (M <= 16, 28672 x 8192): 117 MB of int4 weights = 28 us at 4.2 TB/s; 224 column tiles on
//      132 SMs (1.7 waves); floor asked for: 49 us = 2.5x bf16. Issue-bound: SASS of one K-stage (8 KB of
//      weights) of one consumer warp, bf16 output, int4 activations (fp8: -4 to -8):
//        16 tokens: 232.5 instructions with the table lookup (measured 64.4 us at M = 1, ncu) -> 137
//                   with offset codes (conversion 40 = 16 LOP3 + 8 SHF + 16 PRMT; promotion 32; scale
//                   decode 12; LDS 8; QGMMA 8; uniform descriptor/pipe ops ~25);
//         8 tokens: 115 (M <= 8: half the promotion and activation-scale work of the 16-token tile);
//        32 tokens: 286.5 -> 193.5.
//      8 warps x 137 / 4 schedulers = 274 issue clk per 8 KB: ~7 TB/s at full issue over 132 SMs, so
//      memory-bound again at >= 60% issue efficiency (8 tokens: 230 clk). (Counted with the correction
//      wgmmas of sessions 3-47.) Measured (session 4): the consumers' per-stage chain with 2 consumer warps per
//      scheduler was the limit, not the rounds of tiles nor the ring depth: two CTAs per SM took
//      1 x 28672 x 8192 from 51.5 to ~45 us; stream-K keeps all CTAs busy when the tiles do not divide.
//   fp8 activations could promote with 3 ops per 2 groups (s_x is per 128).

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "common/arrival_counters.h"
#include "common/device_info.h"
#include "common/promotion_records.h"
#include "common/ptx.h"
#include "common/tma.h"
#include "common/wgmma.h"
#include "kernels/sm90/w4a4_gemm.h"
#include "kernels/sm90/w4a4_gemm_plan.h"

namespace jax_w4a4::sm90 {
namespace {

using budget::Lifetime;
using budget::Sharing;
using tma::BulkLoad;
using tma::CpAsync;
using tma::CpAsyncArriveNoinc;
using tma::EncodeTiled;
using tma::MapAddr;
using tma::MbarArrive;
using tma::MbarArriveExpectTx;
using tma::MbarInit;
using tma::MbarWait;
using tma::TmaLoad2d;
using tma::TmaPrefetch;

// ---------------------------------------------------------------------------------------------------
// Compile-time configuration: everything derives from the plan the budget table prints.

// Index of each object in W4A4Plan::objects (checked by name below, so the two cannot drift).
enum PlanObject : int {
  kObjWeights = 0,
  kObjWeightScales,
  kObjActivations,
  kObjActScales,
  kObjLoraUp,
  kObjLaF32,
  kObjLaHalf,
  kObjAlphaBeta,
  kObjStaging,
  kObjBarriers,
};

constexpr bool StartsWith(const char* s, const char* prefix) {
  return *prefix == '\0' || (*s == *prefix && StartsWith(s + 1, prefix + 1));
}

constexpr int kThreads = 384;         // producer warpgroup + 2 consumer warpgroups
constexpr int kConsumerThreads = 128;  // per consumer warpgroup
constexpr int kConsumerWarps = 8;      // both consumer warpgroups
constexpr int kConverterWarps = 2;     // producer warps 2-3
constexpr int kProducerRegisters = 40;
// setmaxnreg only moves registers inside the CTA's launch pool (budget::LaunchRegisters; an .inc beyond
// it blocks forever), so a consumer thread gets the pool less the producers'.
constexpr int ConsumerRegisters(int ctas_per_sm) {
  return budget::ComputeRegistersBesideProducer(kThreads, ctas_per_sm, kThreads - kConsumerWarps * 32,
                                               kProducerRegisters);
}
static_assert(ConsumerRegisters(1) == 232 && ConsumerRegisters(2) == 96, "register split");
constexpr int kRasterGroup = 8;        // token tiles per rasterization group
constexpr int kWeightBlockBytes = 2048;  // 64 rows x 64 k: one group of one consumer warpgroup (prepacked)
constexpr int kExpandedRowsBytes = 64 * kW4A4TileK;  // a consumer warpgroup's rows of an expanded-weights stage
constexpr int kMaxRank = 256;

template <int kShapeIndex>
struct Config {
  static constexpr W4A4Shape kShape = kW4A4Shapes[kShapeIndex];
  static constexpr W4A4Plan kPlan = SolveW4A4Plan(kShape);
  static constexpr int kTileN = kShape.tile_n;
  static constexpr int kTileM = kShape.tile_m;
  static constexpr int kCluster = kShape.cluster;
  static constexpr bool kStreamK = kCluster == 1;  // may split tiles over CTAs (W4A4UsesStreamK decides)
  static constexpr int kCtasPerSm = kPlan.ctas_per_sm();
  static constexpr int kConsumerRegisters = ConsumerRegisters(kCtasPerSm);
  static constexpr int kLoraChunk = kShape.lora_chunk;
  static constexpr int kStages = kPlan.main_stages;
  static constexpr int kLoraStages = kPlan.lora_stages;
  static constexpr int kTileK = kW4A4TileK;

  static constexpr int kSliceN = kTileM < 64 ? kTileM : 64;  // tokens per wgmma (its N)
  static constexpr int kSlices = kTileM / kSliceN;
  // K-stages a consumer issues before it drains its wgmmas, and its partial-accumulator sets. Small
  // token tiles (decode) are bound by the latency of one stage's wait-promote-release chain, not by the
  // tensor cores: four (tiles 8, 16) or two (tile 32) stages in flight per chain; each unit then has its
  // own partial set (4, 8 or 16 registers). The 64- and 128-token tiles alternate two sets, one promoted while
  // the other runs. The 256-token tile's 128 accumulator registers leave room for one partial and one product
  // set of n64 (its units run one at a time, the other warpgroup's fill the tensor cores meanwhile). Session 53,
  // 8192³ against the 128-token tile: -4.8% so, -2.9% with two sets of n32 slices; n32 slices alone cost the
  // 128-token tile 7.5%.
  // Two CTAs per SM leave 96 registers per consumer thread: two stages of weight fragments at 8 tokens, one at
  // 16 (two would not fit beside the 16-token partials, and ptxas would serialize the wgmmas, C7512).
  static constexpr int kStagesPerStep =
      kCtasPerSm > 1 ? (kTileM <= 8 ? 2 : 1) : kTileM <= 16 ? 4 : kTileM <= 32 ? 2 : 1;
  static constexpr int kPartSets = kTileM <= 32 ? kStagesPerStep * kSlices * 2 : kTileM <= 128 ? 2 : 1;
  static_assert(kPartSets <= 8, "WgmmaWaitPending covers up to 7 pending groups");
  // Decode tiles convert the weights to offset codes (byte q + 8, Int4x8ToOffsetE4m3) and cancel the
  // offset with two more wgmmas per unit; prefill tiles keep the exact table lookup (there the extra
  // wgmmas would cost tensor time).
  static constexpr bool kOffsetWeights = W4A4OffsetWeights(kShape);
  // Long prefills: e4m3 weights expanded before the GEMM (ExpandWeightsKernel), A fragments by ldmatrix.
  static constexpr bool kExpandedWeights = kShape.expanded_weights;
  static_assert(!(kOffsetWeights && kExpandedWeights));
  static constexpr int kHalfRows = kTileM / kCluster;        // token rows each CTA of the cluster issues

  // One buffer of each object (bytes), as the kernel uses it.
  static constexpr int kWeightBytes = kExpandedWeights ? kTileN * kTileK : kTileN * kTileK / 2;
  static constexpr int kWeightScaleBytes = kTileN * 4;       // 2 groups x 16-bit per column
  static constexpr int kActBytes = kTileM * kTileK;          // e4m3 codes
  static constexpr int kActHalfBytes = kHalfRows * kTileK;
  static constexpr bool kScaleProductTile = W4A4ScaleProductMma(kShape);  // with 16-bit activation scales
  static constexpr int kActScalePitch = kW4A4ActScalePitch;  // bytes per token record of the scale buffer
  static constexpr int kActScaleBytes = kTileM * kActScalePitch;   // decode: 2 records; prefill: the scale word
  static constexpr int kLoraUpBytes = kLoraChunk * kTileN * 2;
  static constexpr int kLaF32Bytes = kTileM * kLoraChunk * 4;
  static constexpr int kLaF32HalfBytes = kHalfRows * kLoraChunk * 4;
  static constexpr int kLaRowBytes = kLoraChunk * 2;         // one token row of the converted LA chunk
  static constexpr int kLaHalfBytes = kTileM * kLaRowBytes;
  static constexpr int kAlphaBytes = kTileN * 4;
  static constexpr int kBiasBytes = kTileN * 2;
  static constexpr int kStagedTokens = W4A4StagedTokens(kShape);  // per TMA store of the epilogue
  static constexpr int kStagingBytes = kStagedTokens * kTileN * 2;
  static constexpr int kBarriers = 2 * kStages + 3 * kLoraStages;  // full, empty | full, converted, empty

  // The 32-token tile loads a stage's promotion records with one TMA box (16 bytes x 32 rows of the (m, k/8)-byte
  // records) beside its other loads; the 8- and 16-token tiles copy a record a token by cp.async, and prefill tiles
  // 4 bytes of scale words a token (the scale wgmma's rows are 16 bytes apart, which no box of the (m, k/32)-byte
  // scales fills). Measured (session 50, JAX-level A/B): the box saves the 32-token tile 3.5% (its 32 copies and
  // arrivals a stage), and costs the 8- and 16-token tiles 1-3.7% (16 x 8192^2 linear 21.7 -> 22.3 us).
  static constexpr bool kRecordsByTma = kOffsetWeights && kTileM == 32;
  static_assert(!kRecordsByTma || kCluster == 1, "the records box is private to a CTA");
  static constexpr int kRecordBytes = kRecordsByTma ? kActScaleBytes : 0;
  // What a main stage delivers: TMA bytes (tensor and bulk copies, counted by the full barrier's tx-count)
  // + cp.async bytes (prefill's scale words, counted by the 32 arrivals of cp.async.mbarrier.arrive.noinc).
  static constexpr int kMainTmaTxBytes = kWeightBytes + kWeightScaleBytes + kActBytes + kRecordBytes;
  static constexpr int kMainCpAsyncBytes = kRecordsByTma ? 0 : kActScaleBytes;
  static constexpr int kMainTmaIssuedBytes = kWeightBytes + kWeightScaleBytes + kActHalfBytes + kRecordBytes;
  static constexpr int kMainFullArrivals = kRecordsByTma ? 1 : 1 + 32;
  static constexpr int kMainEmptyArrivals = kConsumerWarps * kCluster;
  static constexpr int kLoraFullArrivals = 1;
  static constexpr int kLoraConvertedArrivals = kConverterWarps;
  static constexpr int kLoraEmptyArrivals = kConsumerWarps + kConverterWarps * kCluster;

  static constexpr int64_t kSmemBytes = kPlan.total_bytes() + kW4A4SmemAlignSlack;  // + base alignment

  static_assert(kPlan.fits(), "the shared-memory plan does not fit");
  static_assert(kSmemBytes <= budget::kSmemPerBlockSm90, "plan + base alignment exceeds 227 KB");
  static_assert(kCtasPerSm * (kSmemBytes + budget::kSmemReservedPerCtaSm90) <= budget::kSmemPerSmSm90,
                "kCtasPerSm CTAs must fit one SM's shared memory");
  static_assert(128 * kProducerRegisters + 256 * kConsumerRegisters <=
                    kThreads * budget::LaunchRegisters(kThreads, kCtasPerSm),
                "setmaxnreg must stay inside the CTA's register pool");
  static_assert(kTileN == 128, "two consumer warpgroups of 64 columns");
  static_assert(kTileM % 8 == 0 && kTileM <= 256 && kTileM % kSliceN == 0 && kTileM % kStagedTokens == 0,
                "token tile");
  static_assert(kTileM % 16 == 0 || kTileM == 8, "the epilogue stores blocks of 16 tokens, or one of 8");
  static_assert(kCluster == 1 || kCluster == 2, "cluster of 1 or 2 CTAs along N");
  static_assert(kLoraChunk == 16 || kLoraChunk == 32 || kLoraChunk == 64,
                "the LA B operand uses the 32-, 64- or 128-byte swizzle");
  static constexpr uint32_t kLaSwizzle =
      kLaRowBytes == 128 ? kSwizzle128B : kLaRowBytes == 64 ? kSwizzle64B : kSwizzle32B;
  static_assert(kShape.act_value_bits == 8, "activations are e4m3 codes");
  static_assert(kHalfRows * kTileK % budget::kSwizzledAlign == 0, "a multicast half keeps the swizzle phase");
  static_assert(kStages >= kW4A4MinMainStages && kLoraStages >= 1, "pipeline depth");
  static_assert(kStagesPerStep <= kStages, "a consumer step holds kStagesPerStep stages at once");

  static constexpr bool ObjectIs(int i, const char* name, int64_t bytes, int stages, Sharing sharing,
                                 Lifetime lifetime) {
    return StartsWith(kPlan.objects[i].name, name) && kPlan.objects[i].bytes == bytes &&
           kPlan.objects[i].stages == stages && kPlan.objects[i].sharing == sharing &&
           kPlan.objects[i].lifetime == lifetime;
  }
  static constexpr Sharing kTokens = kCluster > 1 ? Sharing::kMulticast : Sharing::kPrivate;
  static_assert(ObjectIs(kObjWeights, "weights", kWeightBytes, kStages, Sharing::kPrivate, Lifetime::kMainLoop));
  static_assert(ObjectIs(kObjWeightScales, "weight scales", kWeightScaleBytes, kStages, Sharing::kPrivate,
                         Lifetime::kMainLoop));
  static_assert(ObjectIs(kObjActivations, "activations", kActBytes, kStages, kTokens, Lifetime::kMainLoop));
  static_assert(ObjectIs(kObjActScales, "activation scales", kActScaleBytes, kStages, kTokens, Lifetime::kMainLoop));
  static_assert(ObjectIs(kObjLoraUp, "L_up chunk", kLoraUpBytes, kLoraStages, Sharing::kPrivate, Lifetime::kLowRank));
  static_assert(ObjectIs(kObjLaF32, "LA chunk (fp32", kLaF32Bytes, kLoraStages, kTokens, Lifetime::kLowRank));
  static_assert(ObjectIs(kObjLaHalf, "LA chunk (16-bit", kLaHalfBytes, kLoraStages, Sharing::kPrivate,
                         Lifetime::kLowRank));
  static_assert(ObjectIs(kObjAlphaBeta, "alpha, beta", 2 * kAlphaBytes, kLoraStages, Sharing::kPrivate,
                         Lifetime::kLowRank));
  static_assert(kAlphaBytes + kBiasBytes <= 2 * kAlphaBytes, "α fp32 and β 16-bit fit the α/β buffer");
  static_assert(ObjectIs(kObjStaging, "output tile staging", kStagingBytes, 1, Sharing::kPrivate, Lifetime::kEpilogue));
  static_assert(ObjectIs(kObjBarriers, "mbarriers", kPlan.objects[kObjBarriers].bytes, 1, Sharing::kPrivate,
                         Lifetime::kKernel));
  static_assert(kBarriers * budget::kMbarrierBytes <= kPlan.objects[kObjBarriers].bytes, "mbarrier count");
  // The byte accounting of a main stage: what the full barrier waits for is the plan's tx bytes, and
  // what this CTA's TMA issues is the plan's issue split (prefill's scale words, by cp.async, are not split).
  static_assert(kMainTmaTxBytes + kMainCpAsyncBytes == kPlan.main_stage_tx_bytes(), "main stage tx bytes");
  static_assert(kMainTmaTxBytes == kPlan.objects[kObjWeights].expected_tx_bytes() +
                                       kPlan.objects[kObjWeightScales].expected_tx_bytes() +
                                       kPlan.objects[kObjActivations].expected_tx_bytes() +
                                       (kRecordsByTma ? kPlan.objects[kObjActScales].expected_tx_bytes() : 0));
  static_assert(kMainTmaIssuedBytes == kPlan.objects[kObjWeights].issued_bytes(kCluster) +
                                           kPlan.objects[kObjWeightScales].issued_bytes(kCluster) +
                                           kPlan.objects[kObjActivations].issued_bytes(kCluster) +
                                           (kRecordsByTma ? kPlan.objects[kObjActScales].issued_bytes(kCluster) : 0));
  static_assert(kMainCpAsyncBytes == (kRecordsByTma ? 0 : kPlan.objects[kObjActScales].expected_tx_bytes()));
  static_assert(kWeightScaleBytes % 16 == 0, "the weight scales of a stage are one bulk copy (16-byte multiple)");
  static_assert(kLoraUpBytes + kLaF32Bytes + kAlphaBytes + kBiasBytes < (1 << 20), "mbarrier tx-count range");
};

// Shared-memory layout: the plan's objects, swizzled (1024-aligned) ones first, each region the
// object's footprint; the sum is the plan's total.
template <class C>
struct Smem {
  static constexpr int64_t Footprint(int i) { return C::kPlan.objects[i].footprint(); }
  // Bytes between the buffers of consecutive stages (shared-memory addresses are 32-bit).
  static constexpr uint32_t Stride(int i) { return static_cast<uint32_t>(Footprint(i) / C::kPlan.objects[i].stages); }
  static constexpr int64_t kWeights = 0;
  static constexpr int64_t kActivations = kWeights + Footprint(kObjWeights);
  static constexpr int64_t kLoraUp = kActivations + Footprint(kObjActivations);
  static constexpr int64_t kLaHalf = kLoraUp + Footprint(kObjLoraUp);
  static constexpr int64_t kStaging = kLaHalf + Footprint(kObjLaHalf);
  static constexpr int64_t kLaF32 = kStaging + Footprint(kObjStaging);
  static constexpr int64_t kWeightScales = kLaF32 + Footprint(kObjLaF32);
  static constexpr int64_t kActScales = kWeightScales + Footprint(kObjWeightScales);
  static constexpr int64_t kAlphaBeta = kActScales + Footprint(kObjActScales);
  static constexpr int64_t kBarriers = kAlphaBeta + Footprint(kObjAlphaBeta);
  static constexpr int64_t kEnd = kBarriers + Footprint(kObjBarriers);
  static_assert(kEnd == C::kPlan.total_bytes(), "layout == plan");
  static_assert(kActivations % 1024 == 0 && Stride(kObjActivations) % 1024 == 0, "swizzled B operand");
  static_assert(!C::kExpandedWeights || (kWeights % 1024 == 0 && Stride(kObjWeights) % 1024 == 0),
                "swizzled expanded weights (ExpandedFragments XORs chunks with the row mod 8)");
  static_assert(kLoraUp % 1024 == 0 && Stride(kObjLoraUp) % 1024 == 0, "swizzled A operand");
  static_assert(kLaHalf % 1024 == 0 && Stride(kObjLaHalf) % 1024 == 0, "swizzled LA operand");
  static_assert(kStaging % 1024 == 0 && C::kStagedTokens * 128 % 1024 == 0, "swizzled staging, per warpgroup");
  static_assert(kLaF32 % 128 == 0 && kWeightScales % 128 == 0 && kActScales % 128 == 0 && kAlphaBeta % 128 == 0 &&
                kBarriers % 8 == 0, "TMA / bulk-copy destinations");
  static_assert(Stride(kObjWeights) == C::kWeightBytes && Stride(kObjLoraUp) == C::kLoraUpBytes);

  // Barrier indices.
  static constexpr int kFull = 0;
  static constexpr int kEmpty = kFull + C::kStages;
  static constexpr int kLoraFull = kEmpty + C::kStages;
  static constexpr int kLoraConverted = kLoraFull + C::kLoraStages;
  static constexpr int kLoraEmpty = kLoraConverted + C::kLoraStages;
  static_assert(kLoraEmpty + C::kLoraStages == C::kBarriers);
};

// ---------------------------------------------------------------------------------------------------
// Kernel parameters.

struct KernelParams {
  const uint8_t* s_x;      // activation scales, (m, k/32) bytes per token row
  const float2* promotion_records;  // decode tiles: (m, k/64) promotion records (W4A4PromotionRecordsBytes)
  const uint8_t* wscales;  // weight scales, stage-major: k/128 rows of n x 4 bytes (2 groups per column)
  const float* alpha;      // nullptr when absent
  const void* bias;        // nullptr when absent
  int m;
  int n;
  int k;
  int rank;
  int k_stages;       // k / 128
  int m_tiles;        // token tiles
  int n_tiles;        // column tiles of 128
  int n_groups;       // cluster tiles along N: ceil(n_tiles / cluster)
  int cluster_tiles;  // m_tiles x n_groups
  // Stream-K (w4a4_gemm_plan.h; cluster 1 only): iterations = cluster_tiles x k_stages dealt evenly over
  // the grid; 0 runs whole tiles in rounds.
  int iterations;    // iterations x gridDim.x < 2^31 (W4A4UsesStreamK)
  float4* partials;  // per CTA and consumer warpgroup: the fp32 partial of the CTA's leading segment
  uint32_t act_quant_ctas;  // W4A4GemmSm90Args::act_quant_ctas (WaitForTokens)
};

// ---------------------------------------------------------------------------------------------------
// PTX wrappers.

// Arrive on the barrier at the same offset in CTA `cta` of the cluster (this CTA included).
__device__ __forceinline__ void MbarArriveCluster(uint32_t bar, uint32_t cta) {
  asm volatile(
      "{\n.reg .b32 remote;\nmapa.shared::cluster.u32 remote, %0, %1;\n"
      "mbarrier.arrive.shared::cluster.b64 _, [remote];\n}" ::"r"(bar),
      "r"(cta)
      : "memory");
}

// Writes the box into the same offset of every CTA in `mask`; each destination's barrier (same offset)
// receives the complete_tx.
__device__ __forceinline__ void TmaLoad2dMulticast(const CUtensorMap& map, uint32_t dst, uint32_t bar, int c0, int c1,
                                                   uint16_t mask) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster"
      " [%0], [%1, {%3, %4}], [%2], %5;" ::"r"(dst),
      "l"(MapAddr(map)), "r"(bar), "r"(c0), "r"(c1), "h"(mask)
      : "memory");
}

// L2 policies for the weight stream: evict-first when every weight is read once (one token tile), so the
// stream does not push the scales, activations and outputs out of L2; normal when other token tiles re-read it.
__device__ __forceinline__ uint64_t WeightL2Policy(bool read_once) {
  return read_once ? ptx::L2EvictFirstPolicy() : ptx::L2EvictNormalPolicy();
}

__device__ __forceinline__ void TmaStore2d(const CUtensorMap& map, uint32_t src, int c0, int c1) {
  asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%2, %3}], [%1];" ::"l"(MapAddr(map)),
               "r"(src), "r"(c0), "r"(c1)
               : "memory");
}

__device__ __forceinline__ void BulkCommit() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }
__device__ __forceinline__ void BulkWaitRead0() { asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory"); }
__device__ __forceinline__ void BulkWait0() { asm volatile("cp.async.bulk.wait_group 0;" ::: "memory"); }

__device__ __forceinline__ void NamedBarrierSync(uint32_t id, uint32_t threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

// Stream-K flags: GPU-scope release/acquire (the partial's stores, ordered by a barrier, happen before the flag);
// LoadAcquire also reads the linear's token-ready counter (WaitForTokens).
__device__ __forceinline__ void StoreRelease(uint32_t* flag, uint32_t value) {
  asm volatile("st.release.gpu.global.u32 [%0], %1;" ::"l"(flag), "r"(value) : "memory");
}

__device__ __forceinline__ uint32_t LoadAcquire(const uint32_t* flag) {
  uint32_t value;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(value) : "l"(flag) : "memory");
  return value;
}

__device__ __forceinline__ void StMatrixX2Trans(uint32_t addr, uint32_t r0, uint32_t r1) {
  asm volatile("stmatrix.sync.aligned.m8n8.x2.trans.shared.b16 [%0], {%1, %2};" ::"r"(addr), "r"(r0), "r"(r1)
               : "memory");
}

__device__ __forceinline__ void StMatrixX4Trans(uint32_t addr, uint32_t r0, uint32_t r1, uint32_t r2, uint32_t r3) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};" ::"r"(addr), "r"(r0),
               "r"(r1), "r"(r2), "r"(r3)
               : "memory");
}

__device__ __forceinline__ uint32_t Lds16(uint32_t addr) {
  uint16_t v;
  asm volatile("ld.shared.b16 %0, [%1];" : "=h"(v) : "r"(addr));
  return v;
}
__device__ __forceinline__ uint32_t Lds32(uint32_t addr) {
  uint32_t v;
  asm volatile("ld.shared.b32 %0, [%1];" : "=r"(v) : "r"(addr));
  return v;
}
__device__ __forceinline__ uint2 Lds64(uint32_t addr) {
  uint2 v;
  asm volatile("ld.shared.v2.b32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "r"(addr));
  return v;
}
__device__ __forceinline__ uint4 Lds128(uint32_t addr) {
  uint4 v;
  asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr));
  return v;
}
__device__ __forceinline__ void Sts128(uint32_t addr, uint4 v) {
  asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};" ::"r"(addr), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
               : "memory");
}


// ---------------------------------------------------------------------------------------------------
// Numeric helpers.

// int4 -> e4m3 by table lookup: two prmt pick the candidates for the low 3 bits from the e4m3 codes of
// 0..7 and of -8..-1, a third picks per byte by the sign bit (bit 3 of the nibble moved to bit 2 of
// the final selector). 8 nibbles of `w` -> 4 e4m3 bytes of its low half in `lo`, of its high half in `hi`.
__device__ __forceinline__ void Int4x8ToE4m3(uint32_t w, uint32_t& lo, uint32_t& hi) {
  constexpr uint32_t kPositive0 = 0x44403800u;  // e4m3 of 0, 1, 2, 3 (byte 0 first)
  constexpr uint32_t kPositive1 = 0x4E4C4A48u;  // 4, 5, 6, 7
  constexpr uint32_t kNegative0 = 0xCACCCED0u;  // -8, -7, -6, -5
  constexpr uint32_t kNegative1 = 0xB8C0C4C8u;  // -4, -3, -2, -1
  const uint32_t index = w & 0x77777777u;
  const uint32_t select = ((w >> 1) & 0x44444444u) | 0x32103210u;
  lo = __byte_perm(__byte_perm(kPositive0, kPositive1, index), __byte_perm(kNegative0, kNegative1, index), select);
  const uint32_t index_hi = index >> 16;
  hi = __byte_perm(__byte_perm(kPositive0, kPositive1, index_hi), __byte_perm(kNegative0, kNegative1, index_hi),
                   select >> 16);
}

// (a & 0x0F0F0F0F) ^ flip as one LOP3: written in C++, nvcc emits and + xor (two immediates) and ptxas
// keeps them apart; with `flip` in a register (ptxas hoists it) it is a single instruction.
__device__ __forceinline__ uint32_t LowNibblesXor(uint32_t a, uint32_t flip) {
  uint32_t d;
  asm("lop3.b32 %0, %1, 0x0F0F0F0F, %2, 0x6A;" : "=r"(d) : "r"(a), "r"(flip));  // 0x6A: (a & b) ^ c
  return d;
}

// int4 -> offset e4m3 (decode tiles): the byte u = q + 8 = q ^ 8 in [0, 15], read as e4m3, is exactly
// u·2^-9 (u < 8: subnormal, mantissa u, 2^-9 per step; u >= 8: exponent field 1, (1 + (u - 8)/8)·2^-6).
// The even nibbles masked in place and the odd ones shifted down give bytes (q0, q2, q4, q6) and (q1, q3,
// q5, q7), + 8 each; two prmt interleave them into Int4x8ToE4m3's byte order: nibbles 0-3 -> `lo`, 4-7 ->
// `hi`. 5 instructions per 8 values (LOP3, SHF + LOP3, 2 PRMT) instead of 11. The wgmma then sums
// 2^-9 Σ x (q + 8); the promotion records (PromoteOffset) and 2^9 with α turn it into Σ x q.
// Modelled instruction by instruction in tests/test_w4a4_conversion.py.
__device__ __forceinline__ void Int4x8ToOffsetE4m3(uint32_t w, uint32_t& lo, uint32_t& hi) {
  const uint32_t even = LowNibblesXor(w, 0x08080808u);
  const uint32_t odd = LowNibblesXor(w >> 4, 0x08080808u);
  lo = __byte_perm(even, odd, 0x5140);  // even byte 0, odd byte 0, even byte 1, odd byte 1
  hi = __byte_perm(even, odd, 0x7362);  // even byte 2, odd byte 2, even byte 3, odd byte 3
}

// A thread's two k32 A fragments of one group: word j of the 16-byte load -> registers 2j, 2j+1;
// registers 0-3 are k-step 0, 4-7 k-step 1 (formats/svdq_layout.py).
template <bool kOffset>
__device__ __forceinline__ void WeightFragments(uint4 raw, uint32_t (&a)[8]) {
  if constexpr (kOffset) {
    Int4x8ToOffsetE4m3(raw.x, a[0], a[1]);
    Int4x8ToOffsetE4m3(raw.y, a[2], a[3]);
    Int4x8ToOffsetE4m3(raw.z, a[4], a[5]);
    Int4x8ToOffsetE4m3(raw.w, a[6], a[7]);
  } else {
    Int4x8ToE4m3(raw.x, a[0], a[1]);
    Int4x8ToE4m3(raw.y, a[2], a[3]);
    Int4x8ToE4m3(raw.z, a[4], a[5]);
    Int4x8ToE4m3(raw.w, a[6], a[7]);
  }
}

// Expanded weights (the prefill instance on them, kW4A4ExpandedWeightsMinTokens): the prepacked int4 weights as
// e4m3 codes, (n, k) row-major bytes, converted with the consumers' exact table (WeightFragments). A CTA of 128
// threads takes 64 rows x 128 k (two prepacked blocks, each thread 2 x 16 bytes), places each fragment register
// where the wgmma A fragment order puts it (formats/svdq_layout.py: register r of k-step s holds row
// 16 w + g + 8 (r & 1), columns 32 s + 16 (r >> 1) + 4 t + {0..3}) in a shared tile, and stores the tile as
// whole 128-byte rows. (Storing the registers straight to global memory, 8 rows x 16 bytes per warp store,
// made 8192³ 31 us slower, 1428 against 1397 us, and 1 x 8192² 32 us: session 19.)
// The consumers read an expanded stage into the same A fragments with ldmatrix (a warp's 16 rows x 32 k of a k-step
// are the four 8 x 16-byte matrices of registers 0-3), once per stage for both token slices. As a shared-memory
// wgmma operand, A was read again by every slice's wgmmas (session 20, 8192³: 1393-1396 -> 1386-1388 us, L1
// throughput 74 -> 64%).
__device__ __forceinline__ void ExpandedFragments(uint32_t rows, int warp_in_group, int lane, uint32_t (&a)[2][8]) {
  // Lanes 8i..8i+7 address matrix i: rows + 8 (i & 1), 16-byte chunk + (i >> 1); 128-byte swizzle: the chunk
  // is XORed with the row mod 8 (the stage and each warpgroup's rows are 1 KB-aligned).
  const int row = 16 * warp_in_group + (lane & 7) + 8 * ((lane >> 3) & 1);
  const uint32_t row_address = rows + 128 * row;
#pragma unroll
  for (int gi = 0; gi < 2; ++gi) {
#pragma unroll
    for (int s = 0; s < 2; ++s) {
      const int chunk = 4 * gi + 2 * s + (lane >> 4);
      uint32_t (&fragment)[4] = *reinterpret_cast<uint32_t(*)[4]>(&a[gi][4 * s]);
      ptx::LdMatrixX4(fragment, row_address + 16 * (chunk ^ (lane & 7)));
    }
  }
}

constexpr int kExpandTileK = 128;
constexpr int kExpandPitch = kExpandTileK + 16;  // a warp's fragment stores land in 32 distinct banks (4 g + t)

__global__ void __launch_bounds__(kConsumerThreads) ExpandWeightsKernel(const uint4* __restrict__ prepacked,
                                                                        uint8_t* __restrict__ expanded, int k) {
  __shared__ __align__(16) uint8_t tile[64 * kExpandPitch];
  const int k_tiles = k / kExpandTileK;
  const int nb = blockIdx.x / k_tiles;
  const int kt = blockIdx.x % k_tiles;
  const int tid = threadIdx.x;
  const int w = tid / 32, g = (tid % 32) / 4, t = tid % 4;
#pragma unroll
  for (int h = 0; h < kExpandTileK / 64; ++h) {
    uint32_t a[8];
    const int64_t block = int64_t{nb} * (k / 64) + kt * (kExpandTileK / 64) + h;
    WeightFragments<false>(prepacked[block * kConsumerThreads + tid], a);
#pragma unroll
    for (int o = 0; o < 8; ++o) {
      const int s = o / 4, r = o % 4;
      const int row = 16 * w + g + 8 * (r & 1);
      const int col = 64 * h + 32 * s + 16 * (r >> 1) + 4 * t;
      *reinterpret_cast<uint32_t*>(&tile[row * kExpandPitch + col]) = a[o];
    }
  }
  __syncthreads();
  constexpr int kChunks = kExpandTileK / 16;  // 16-byte chunks per row
#pragma unroll
  for (int i = tid; i < 64 * kChunks; i += kConsumerThreads) {
    const int row = i / kChunks, chunk = i % kChunks;
    const uint4 v = *reinterpret_cast<const uint4*>(&tile[row * kExpandPitch + 16 * chunk]);
    *reinterpret_cast<uint4*>(expanded + (64 * int64_t{nb} + row) * k + kt * kExpandTileK + 16 * chunk) = v;
  }
}
static_assert(kW4A4TileK % kExpandTileK == 0, "K is a multiple of the expansion tile");

template <class T>
__device__ __forceinline__ float HalfBitsToFloat(uint32_t bits16) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    return __uint_as_float(bits16 << 16);
  } else {
    return __half2float(__ushort_as_half(static_cast<unsigned short>(bits16)));
  }
}

// Scale of group `group` (0/1 within the stage) in a 4-byte scale word: two 16-bit scales (weights,
// int4/uint4 activations) or one fp32 scale for both groups (fp8 activations).
template <class T, bool kFp32>
__device__ __forceinline__ float GroupScale(uint32_t word, int group) {
  if constexpr (kFp32) {
    return __uint_as_float(word);
  } else {
    return HalfBitsToFloat<T>(group ? word >> 16 : word & 0xFFFFu);
  }
}

template <class T>
__device__ __forceinline__ uint32_t PackHalf2(float lo, float hi) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
  } else {
    __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
  }
}

// ---------------------------------------------------------------------------------------------------
// Pipeline state and tile scheduler.

// One role's position in a ring of kDepth stages: the slot and the parity of its current use.
template <int kDepth>
struct PipeState {
  int index = 0;
  uint32_t phase = 0;
  __device__ __forceinline__ void Advance() {
    if (++index == kDepth) {
      index = 0;
      phase ^= 1;
    }
  }
};

struct Tile {
  int m0;      // first token
  int n0;      // first output column
  bool valid;  // false for the phantom column tile of an odd tile count
};

// Cluster tile -> this CTA's tile. Groups of kRasterGroup token tiles; inside a group the token tile
// varies fastest, so the clusters running together share the weights of a few column groups.
template <class C>
__device__ __forceinline__ Tile TileAt(int cluster_tile, const KernelParams& p, uint32_t cta_rank) {
  const int group_span = kRasterGroup * p.n_groups;
  const int group = cluster_tile / group_span;
  const int first_m = group * kRasterGroup;
  const int rows = min(kRasterGroup, p.m_tiles - first_m);
  const int in_group = cluster_tile - group * group_span;
  const int m_tile = first_m + in_group % rows;
  const int n_tile = (in_group / rows) * C::kCluster + static_cast<int>(cta_rank);
  return Tile{m_tile * C::kTileM, n_tile * C::kTileN, n_tile < p.n_tiles};
}

// Token halves (one per CTA of the cluster) with at least one row < M: the same count in every CTA,
// so the bytes each full barrier expects match what the cluster issues.
template <class C>
__device__ __forceinline__ int TokenHalvesInBounds(const Tile& tile, const KernelParams& p) {
  const int rows = min(p.m - tile.m0, C::kTileM);
  return (rows + C::kHalfRows - 1) / C::kHalfRows;
}

// A CTA's work, walked identically by every role: segments (cluster tile, k-stages [ks_begin, ks_end)).
// Whole tiles in rounds (ct += #clusters), or, with stream-K, the CTA's range of iterations
// [b T / G, (b + 1) T / G): its leading segment may be the tail of a tile, its last the head of one.
// The walk keeps no 64-bit state (the consumers' registers are tight): the next segment follows from the
// current one.
struct Segment {
  int ct;
  int ks_begin;
  int ks_end;
};

// The segment that runs a tile's first k-stage finishes the tile (low-rank, α/β, epilogue); the others only
// leave partials.
__device__ __forceinline__ bool FinishesTile(const Segment& s) { return s.ks_begin == 0; }

__device__ __forceinline__ int RangeBegin(const KernelParams& p, uint32_t cta) {
  return static_cast<int>(static_cast<uint32_t>(p.iterations) * cta / gridDim.x);
}

// Stream-K: the segment of this CTA's range that starts at iteration i, if i is inside the range.
__device__ __forceinline__ bool SegmentAt(const KernelParams& p, int i, Segment& s) {
  const int end = RangeBegin(p, blockIdx.x + 1);
  if (i >= end) return false;
  s.ct = i / p.k_stages;
  s.ks_begin = i - s.ct * p.k_stages;
  s.ks_end = min(p.k_stages, s.ks_begin + (end - i));
  return true;
}

template <class C>
__device__ __forceinline__ bool FirstSegment(const KernelParams& p, Segment& s) {
  if (C::kStreamK && p.iterations > 0) return SegmentAt(p, RangeBegin(p, blockIdx.x), s);
  s = Segment{static_cast<int>(blockIdx.x / C::kCluster), 0, p.k_stages};
  return s.ct < p.cluster_tiles;
}

template <class C>
__device__ __forceinline__ bool NextSegment(const KernelParams& p, Segment& s) {
  if (C::kStreamK && p.iterations > 0) return SegmentAt(p, s.ct * p.k_stages + s.ks_end, s);
  s.ct += gridDim.x / C::kCluster;
  return s.ct < p.cluster_tiles;
}

// Stream-K: the CTA whose range holds iteration i (ranges begin at floor(b T / G)).
__device__ __forceinline__ int OwnerOfIteration(const KernelParams& p, int i) {
  const uint32_t t = static_cast<uint32_t>(p.iterations);
  return static_cast<int>((static_cast<uint32_t>(i + 1) * gridDim.x + t - 1) / t - 1);
}

__device__ __forceinline__ int LoraItems(int rank, int chunk) { return rank > 0 ? (rank + chunk - 1) / chunk : 1; }

// ---------------------------------------------------------------------------------------------------
// Roles.

template <class C>
struct Barriers {
  uint32_t base;
  __device__ __forceinline__ uint32_t At(int i) const { return base + 8 * i; }
  __device__ __forceinline__ uint32_t Full(int s) const { return At(Smem<C>::kFull + s); }
  __device__ __forceinline__ uint32_t Empty(int s) const { return At(Smem<C>::kEmpty + s); }
  __device__ __forceinline__ uint32_t LoraFull(int s) const { return At(Smem<C>::kLoraFull + s); }
  __device__ __forceinline__ uint32_t LoraConverted(int s) const { return At(Smem<C>::kLoraConverted + s); }
  __device__ __forceinline__ uint32_t LoraEmpty(int s) const { return At(Smem<C>::kLoraEmpty + s); }
};

// The tokens (q_x, s_x) are act_quant's outputs. In the W4A4 linear (p.act_quant_ctas > 0) this kernel runs
// with programmatic dependent launch while act_quant still runs, and the main producer waits for all of
// act_quant's CTAs to arrive at the token-ready counter (each once its codes and scales are stored), not for
// act_quant's end: its LA split sum, which only the low-rank producer needs, ends ~1.5 us later at decode
// (benchmarks/NOTES.md, session 47). Lane 0 polls with acquire loads (one poller a CTA: the arrivals go to one
// L2 line); __syncwarp carries its acquire to the lanes whose cp.async read the scales, and the TMA reads the
// codes through the async proxy, so it also fences the proxies. Then the warp arrives at the handoff barrier,
// where the low-rank producer re-arms the counters (RearmTokens). Outside the linear: griddepcontrol.wait, which
// returns at once without a programmatic launch.
// Named barrier of producer warps 0 and 1 (1 and 2: the consumers'), used with an immediate id: NamedBarrierSync's
// register form compiles to other SASS here, and only this form was timed (session 47).
constexpr uint32_t kHandoffBarrier = 3;

__device__ __forceinline__ void WaitForTokens(const KernelParams& p, int lane) {
  if (p.act_quant_ctas == 0) {
    ptx::WaitForPreviousGrid();
    return;
  }
  if (lane == 0) {
    while (LoadAcquire(g_arrival_counters + kW4A4TokensReadyCounter) < p.act_quant_ctas) {
    }
    asm volatile("fence.proxy.async.global;" ::: "memory");
  }
  __syncwarp();
  asm volatile("bar.arrive %0, 64;" ::"n"(kHandoffBarrier) : "memory");
}

// Warp 1, once its CTA's main producer has passed WaitForTokens (the handoff barrier): the last of the grid's
// CTAs to get here re-arms both handoff counters (common/arrival_counters.h); every main producer has
// read the ready counter for the last time by then, and the next act_quant starts after this kernel ends.
// Not in warp 0: the re-arm atomic's round trip on the tokens' path made session 45's form release the GEMM's
// last CTAs up to 2 us later, and code after warp 0's loop changed the schedule of the whole kernel (the
// GEMM alone 2-3% slower at 1 and 64 tokens; benchmarks/NOTES.md, session 47).
__device__ __forceinline__ void RearmTokens(const KernelParams& p, int lane) {
  if (p.act_quant_ctas == 0) return;
  asm volatile("bar.sync %0, 64;" ::"n"(kHandoffBarrier) : "memory");
  if (lane == 0 && atomicAdd(g_arrival_counters + kW4A4TokensTakenCounter, 1u) == gridDim.x - 1) {
    g_arrival_counters[kW4A4TokensReadyCounter] = 0;
    g_arrival_counters[kW4A4TokensTakenCounter] = 0;
  }
}

// Warp 0: the main K pipeline. Nothing is issued before the tokens are ready (WaitForTokens): issuing the
// weights of the first kStages stages first (session 44) held back stage 0's tokens and cost the GEMM alone
// 1-2 us at every decode size, and the linear up to 1.6 us (benchmarks/NOTES.md, session 45).
template <class C>
__device__ void ProduceMain(const CUtensorMap& tm_w, const CUtensorMap& tm_x, const CUtensorMap& tm_records,
                            const KernelParams& p, uint32_t smem, Barriers<C> bar, uint32_t cta_rank, int lane) {
  using L = Smem<C>;
  const int scale_row_bytes = p.k / 32;  // activation scales: (k/64) x 16-bit or (k/128) x fp32 per token
  const uint64_t weight_policy = WeightL2Policy(p.m_tiles == 1);
  WaitForTokens(p, lane);
  PipeState<C::kStages> state;
  Segment seg;
  for (bool more = FirstSegment<C>(p, seg); more; more = NextSegment<C>(p, seg)) {
    const Tile tile = TileAt<C>(seg.ct, p, cta_rank);
    const int halves = TokenHalvesInBounds<C>(tile, p);
    const bool issue_half = static_cast<int>(cta_rank) < halves;
    const uint32_t tx =
        (tile.valid ? C::kWeightBytes + C::kWeightScaleBytes : 0) + halves * (C::kActHalfBytes + C::kRecordBytes);
    [[maybe_unused]] const uint8_t* xscale_rows = p.s_x + int64_t{tile.m0 + lane} * scale_row_bytes;
    for (int ks = seg.ks_begin; ks < seg.ks_end; ++ks) {
      const int s = state.index;
      MbarWait(bar.Empty(s), state.phase ^ 1);
      const uint32_t full = bar.Full(s);
      if (lane == 0) {
        MbarArriveExpectTx(full, tx);
        if (tile.valid) {
          const uint32_t weights = smem + L::kWeights + s * L::Stride(kObjWeights);
          if constexpr (C::kExpandedWeights) {
            // Expanded (n, k) e4m3: box (128 k, 128 rows), 128-byte swizzle; warpgroup w's rows at w x 8 KB.
            tma::TmaLoad2dHint(tm_w, weights, full, ks * C::kTileK, tile.n0, weight_policy);
          } else {
            // Prepacked (k/64 blocks of 2048 B) x (n/64): box (2048 B, 2 groups, 2 warpgroups).
            tma::TmaLoad3dHint(tm_w, weights, full, 0, 2 * ks, tile.n0 / 64, weight_policy);
          }
          // Stage-major scales: the tile's [column][group 0, group 1] rows of stage ks are contiguous.
          BulkLoad(smem + L::kWeightScales + s * L::Stride(kObjWeightScales),
                   p.wscales + (int64_t{ks} * p.n + tile.n0) * 4, C::kWeightScaleBytes, full);
        }
        if (issue_half) {
          const uint32_t dst = smem + L::kActivations + s * L::Stride(kObjActivations) + cta_rank * C::kActHalfBytes;
          const int row = tile.m0 + static_cast<int>(cta_rank) * C::kHalfRows;
          if constexpr (C::kCluster > 1) {
            TmaLoad2dMulticast(tm_x, dst, full, ks * C::kTileK, row, (1u << C::kCluster) - 1);
          } else {
            TmaLoad2d(tm_x, dst, full, ks * C::kTileK, row);
          }
          if constexpr (C::kRecordsByTma) {
            // The stage's two promotion records per token, 16 bytes at record (= fp32 column) 4 ks; rows past M
            // land as zeros.
            TmaLoad2d(tm_records, smem + L::kActScales + s * L::Stride(kObjActScales), full, 4 * ks, tile.m0);
          }
        }
      }
      if constexpr (!C::kRecordsByTma) {
        // Per token: the 8- and 16-token tiles, the stage's two promotion records (16 bytes of the (m, k/64)
        // records); prefill tiles, 4 bytes of scales ([2 x 16-bit | fp32]) from the (m, k/64) or (m, k/128)
        // layout act_quant writes. A rolled loop: few live registers in the 40-register producer.
        const uint32_t xscale_dst = smem + L::kActScales + s * L::Stride(kObjActScales) + C::kActScalePitch * lane;
        const uint8_t* xscale_src = xscale_rows + 4 * ks;
#pragma unroll 1
        for (int r = lane; r < C::kTileM; r += 32, xscale_src += 32 * scale_row_bytes) {
          const bool in = tile.m0 + r < p.m;  // rows past M read nothing and land as zeros
          const uint32_t dst = xscale_dst + C::kActScalePitch * (r - lane);
          if constexpr (C::kOffsetWeights) {
            // The records sit at 4 times the scales' byte offset (k/8 against k/32 bytes a row).
            const auto* records = reinterpret_cast<const uint8_t*>(p.promotion_records);
            CpAsync<16>(dst, in ? records + 4 * (xscale_src - p.s_x) : records, in ? 16 : 0);
          } else {
            CpAsync<4>(dst, in ? xscale_src : p.s_x, in ? 4 : 0);
          }
        }
        CpAsyncArriveNoinc(full);
      }
      state.Advance();
    }
  }
}

// Warp 1: the low-rank pipeline (L_up chunk, LA chunk, α/β with the tile's first item).
template <class C>
__device__ void ProduceLowRank(const CUtensorMap& tm_up, const CUtensorMap& tm_la, const KernelParams& p,
                               uint32_t smem, Barriers<C> bar, uint32_t cta_rank, int lane) {
  using L = Smem<C>;
  const int items = LoraItems(p.rank, C::kLoraChunk);
  ptx::WaitForPreviousGrid();  // LA is act_quant's output, from its split sum (ProduceMain)
  RearmTokens(p, lane);
  PipeState<C::kLoraStages> state;
  Segment seg;
  for (bool more = FirstSegment<C>(p, seg); more; more = NextSegment<C>(p, seg)) {
    if (!FinishesTile(seg)) continue;
    const Tile tile = TileAt<C>(seg.ct, p, cta_rank);
    const int halves = TokenHalvesInBounds<C>(tile, p);
    const bool issue_half = static_cast<int>(cta_rank) < halves;
    for (int item = 0; item < items; ++item) {
      const int s = state.index;
      MbarWait(bar.LoraEmpty(s), state.phase ^ 1);
      if (lane == 0) {
        const uint32_t full = bar.LoraFull(s);
        const bool chunk = p.rank > 0;
        const bool affine = item == 0 && tile.valid;
        uint32_t tx = 0;
        if (chunk) tx += (tile.valid ? C::kLoraUpBytes : 0) + halves * C::kLaF32HalfBytes;
        if (affine && p.alpha != nullptr) tx += C::kAlphaBytes;
        if (affine && p.bias != nullptr) tx += C::kBiasBytes;
        MbarArriveExpectTx(full, tx);
        if (chunk) {
          const int rank0 = item * C::kLoraChunk;
          if (tile.valid) {
            // Two boxes of 64 columns x kLoraChunk ranks (128-byte swizzle), one per consumer warpgroup.
            const uint32_t dst = smem + L::kLoraUp + s * L::Stride(kObjLoraUp);
            TmaLoad2d(tm_up, dst, full, tile.n0, rank0);
            TmaLoad2d(tm_up, dst + C::kLoraChunk * 128, full, tile.n0 + 64, rank0);
          }
          if (issue_half) {
            const uint32_t dst = smem + L::kLaF32 + s * L::Stride(kObjLaF32) + cta_rank * C::kLaF32HalfBytes;
            const int row = tile.m0 + static_cast<int>(cta_rank) * C::kHalfRows;
            if constexpr (C::kCluster > 1) {
              TmaLoad2dMulticast(tm_la, dst, full, rank0, row, (1u << C::kCluster) - 1);
            } else {
              TmaLoad2d(tm_la, dst, full, rank0, row);
            }
          }
        }
        const uint32_t affine_dst = smem + L::kAlphaBeta + s * L::Stride(kObjAlphaBeta);
        if (affine && p.alpha != nullptr) BulkLoad(affine_dst, p.alpha + tile.n0, C::kAlphaBytes, full);
        if (affine && p.bias != nullptr) {
          BulkLoad(affine_dst + C::kAlphaBytes, static_cast<const uint8_t*>(p.bias) + 2 * tile.n0, C::kBiasBytes, full);
        }
      }
      __syncwarp();
      state.Advance();
    }
  }
}

// Warps 2-3: LA chunk fp32 [tokens][ranks] -> output dtype, K-major with the 128-byte (64-rank chunk), 64-byte
// (32-rank chunk) or 32-byte (16-rank chunk) swizzle: the B operand of the low-rank wgmma.
template <class C, class OutT>
__device__ void ConvertLowRank(const KernelParams& p, uint32_t smem, Barriers<C> bar, int converter_thread,
                               int lane) {
  using L = Smem<C>;
  constexpr int kChunks = C::kLoraChunk / 8;  // 16-byte chunks of 8 ranks per token row
  constexpr int kSwizzleMask = C::kLaRowBytes / 16 - 1;  // 128-, 64- or 32-byte swizzle: chunk ^= row phase
  const int items = LoraItems(p.rank, C::kLoraChunk);
  PipeState<C::kLoraStages> state;
  Segment seg;
  for (bool more = FirstSegment<C>(p, seg); more; more = NextSegment<C>(p, seg)) {
    if (!FinishesTile(seg)) continue;
    for (int item = 0; item < items; ++item) {
      const int s = state.index;
      MbarWait(bar.LoraFull(s), state.phase);
      if (p.rank > 0) {
        const uint32_t src = smem + L::kLaF32 + s * L::Stride(kObjLaF32);
        const uint32_t dst = smem + L::kLaHalf + s * L::Stride(kObjLaHalf);
#pragma unroll 1
        for (int u = converter_thread; u < C::kTileM * kChunks; u += 32 * kConverterWarps) {
          const int row = u / kChunks;
          const int chunk = u % kChunks;
          const uint32_t from = src + 4 * (row * C::kLoraChunk + 8 * chunk);
          const uint4 a = Lds128(from);
          const uint4 b = Lds128(from + 16);
          const uint4 packed{PackHalf2<OutT>(__uint_as_float(a.x), __uint_as_float(a.y)),
                             PackHalf2<OutT>(__uint_as_float(a.z), __uint_as_float(a.w)),
                             PackHalf2<OutT>(__uint_as_float(b.x), __uint_as_float(b.y)),
                             PackHalf2<OutT>(__uint_as_float(b.z), __uint_as_float(b.w))};
          // Swizzle: 16-byte chunk c of a row goes to c ^ (address bits 7.. of the row).
          const int phase = (row * C::kLaRowBytes >> 7) & kSwizzleMask;
          Sts128(dst + row * C::kLaRowBytes + ((chunk ^ phase) << 4), packed);
        }
        FenceProxyAsync();
      }
      __syncwarp();
      if (lane == 0) {
        MbarArrive(bar.LoraConverted(s));
        if constexpr (C::kCluster > 1) {
          for (uint32_t cta = 0; cta < C::kCluster; ++cta) MbarArriveCluster(bar.LoraEmpty(s), cta);
        } else {
          MbarArrive(bar.LoraEmpty(s));
        }
      }
      state.Advance();
    }
  }
}

// This thread's activation-scale words of one slice of a stage: tokens 8i + 2t and 8i + 2t + 1 (both groups in
// each word).
template <class C>
__device__ __forceinline__ void LoadActScaleWords(uint32_t act_scales, int slice, int t,
                                                  uint2 (&words)[C::kSliceN / 8]) {
#pragma unroll
  for (int i = 0; i < C::kSliceN / 8; ++i) {
    const uint32_t row = act_scales + C::kActScalePitch * (slice * C::kSliceN + 8 * i + 2 * t);
    if constexpr (C::kActScalePitch == 4) {
      words[i] = Lds64(row);
    } else {
      words[i] = make_uint2(Lds32(row), Lds32(row + C::kActScalePitch));
    }
  }
}

// acc += part · s_x[token] · s_w[column] for one unit (slice, group) of this thread's fragment.
template <class C, class OutT, bool kFp8Act>
__device__ __forceinline__ void Promote(float (&acc)[C::kSliceN / 2], const float (&part)[C::kSliceN / 2],
                                        const uint2 (&act_scale_words)[C::kSliceN / 8], int group,
                                        const float (&sw)[2]) {
#pragma unroll
  for (int i = 0; i < C::kSliceN / 8; ++i) {
    const float sx0 = GroupScale<OutT, kFp8Act>(act_scale_words[i].x, group);
    const float sx1 = GroupScale<OutT, kFp8Act>(act_scale_words[i].y, group);
    acc[4 * i + 0] = fmaf(part[4 * i + 0] * sx0, sw[0], acc[4 * i + 0]);
    acc[4 * i + 1] = fmaf(part[4 * i + 1] * sx1, sw[0], acc[4 * i + 1]);
    acc[4 * i + 2] = fmaf(part[4 * i + 2] * sx0, sw[1], acc[4 * i + 2]);
    acc[4 * i + 3] = fmaf(part[4 * i + 3] * sx1, sw[1], acc[4 * i + 3]);
  }
}

// Decode tiles (offset weights): acc += (part · s_x[token] + c[token]) · s_w[column] with the token's promotion
// record (s_x, c = -8·2^-9 S s_x, S its code sum), so that part (2^-9 Σ x (q + 8)) loses its offset inside the
// first FFMA, rounded once. The records are loaded at the promotion: loaded with the stage, the 32-token tile's
// cost more registers than they saved latency (session 48); and formed before the GEMM, as its scale and c
// decoded and multiplied here cost 5% at 16 and 32 tokens (session 49).
template <class C>
__device__ __forceinline__ void PromoteOffset(float (&acc)[C::kSliceN / 2], const float (&part)[C::kSliceN / 2],
                                              uint32_t records, int slice, int group, int t, const float (&sw)[2]) {
#pragma unroll
  for (int i = 0; i < C::kSliceN / 8; ++i) {
    const uint32_t a = records + C::kActScalePitch * (slice * C::kSliceN + 8 * i + 2 * t) +  // token 8i + 2t
                       kW4A4PromotionRecordBytes * group;
    const uint2 ra = Lds64(a), rb = Lds64(a + C::kActScalePitch);  // and the next token
    const float sa = __uint_as_float(ra.x), ca = __uint_as_float(ra.y);
    const float sb = __uint_as_float(rb.x), cb = __uint_as_float(rb.y);
    acc[4 * i + 0] = fmaf(fmaf(part[4 * i + 0], sa, ca), sw[0], acc[4 * i + 0]);
    acc[4 * i + 1] = fmaf(fmaf(part[4 * i + 1], sb, cb), sw[0], acc[4 * i + 1]);
    acc[4 * i + 2] = fmaf(fmaf(part[4 * i + 2], sa, ca), sw[1], acc[4 * i + 2]);
    acc[4 * i + 3] = fmaf(fmaf(part[4 * i + 3], sb, cb), sw[1], acc[4 * i + 3]);
  }
}

// acc += part · (s_w[column] s_x[token]) with the products from the scale wgmma (W4A4ScaleProductMma).
template <int kN>
__device__ __forceinline__ void PromoteScaled(float (&acc)[kN / 2], const float (&part)[kN / 2],
                                              const float (&scale_products)[kN / 2]) {
#pragma unroll
  for (int i = 0; i < kN / 2; ++i) acc[i] = fmaf(part[i], scale_products[i], acc[i]);
}

// Whether an instance promotes with the scale wgmma: a tile of 32 tokens or more with 16-bit activation scales
// (fp8 activations carry one fp32 scale per 128 k, which a 16-bit product cannot hold exactly).
template <class C, bool kFp8Act>
inline constexpr bool kUsesScaleProducts = C::kScaleProductTile && !kFp8Act;

// Consumer warpgroup `wg` (0/1): columns [64 wg, 64 wg + 64) of the CTA tile.
template <class C, class OutT, bool kFp8Act>
__device__ void Consume(const CUtensorMap& tm_y, const KernelParams& p, uint32_t smem, Barriers<C> bar,
                        uint32_t cta_rank, int wg, int tid) {
  using L = Smem<C>;
  constexpr int kSliceN = C::kSliceN;
  constexpr int kSlices = C::kSlices;
  constexpr bool kBf16 = std::is_same_v<OutT, __nv_bfloat16>;
  const int warp = tid / 32;
  const int lane = tid % 32;
  const int t = lane % 4;
  const int column = 64 * wg + 16 * warp + lane / 4;  // this thread's columns in the tile: column, column + 8
  const int items = LoraItems(p.rank, C::kLoraChunk);

  auto release_main = [&](int stage) {
    __syncwarp();
    if constexpr (C::kCluster > 1) {
      if (lane < C::kCluster) MbarArriveCluster(bar.Empty(stage), lane);
    } else {
      if (lane == 0) MbarArrive(bar.Empty(stage));
    }
  };

  constexpr int kPartSets = C::kPartSets;
  float acc[kSlices][kSliceN / 2];
  float part[kPartSets][kSliceN / 2];
  // The scale-product path (W4A4ScaleProductMma, 16-bit activation scales): s_w[n]·s_x[m] per unit from a wgmma.
  constexpr bool kScaleMma = kUsesScaleProducts<C, kFp8Act>;
  static_assert(!kScaleMma || kSliceN >= 32, "the scale wgmma is instantiated for n32 and n64 slices");
  // With scale products the low-rank wgmmas run into the partial sets, kLowRankSlices slices at a time.
  constexpr int kLowRankSlices = kScaleMma && kSlices > kPartSets ? kPartSets : kSlices;
  static_assert(kSlices % kLowRankSlices == 0 && (!kScaleMma || kLowRankSlices <= kPartSets));
  // One scale-product set per partial set: a unit's products are issued with its partial, so the previous unit's
  // promotion waits on neither.
  [[maybe_unused]] float scale_products[kPartSets][kSliceN / 2];
  PipeState<C::kStages> state;
  PipeState<C::kLoraStages> lora_state;
  const uint32_t staging = smem + L::kStaging + wg * (C::kStagedTokens * 128);

  // One step: kU K-stages, each of kSlices x 2 units (slice, group): two wgmma k32 into a fresh partial
  // set (scale-d = 0 on the first), one commit. Unit u goes to partial set u % kPartSets; before set
  // u % kPartSets is reused, wgmma.wait_group(kPartSets - 1) retires unit u - kPartSets, which is then
  // promoted while the later units run. The step ends drained (no wgmma in flight across the loop's
  // back edge: ptxas would serialize every wgmma, C7514), promoting each remaining unit as it retires;
  // a stage is released once its last unit is promoted.
  auto main_step = [&](auto stages_per_step) {
    constexpr int kU = decltype(stages_per_step)::value;
    constexpr int kUnitsPerStage = kSlices * 2;
    constexpr int kUnits = kU * kUnitsPerStage;
    constexpr int kSets = kUnits < kPartSets ? kUnits : kPartSets;
    int stage[kU] = {};
    uint32_t a[kU][2][8];  // the register A fragments: [stage][group][k-step 0: 0-3, 1: 4-7]
    uint32_t act_scales[kU] = {};
    // Promotion with the scale wgmma: its A operand, group gi's weight scales at k = gi (lanes with t == 0).
    [[maybe_unused]] uint32_t sw_frag[kU][2][4];
    // Promotion without it: the decoded weight scales and the activation-scale words, loaded as each stage
    // arrives so that no promotion waits on them (16-token tile: -3% against loading them at each promotion).
    [[maybe_unused]] float sw[kU][2][2];
    [[maybe_unused]] uint2 act_scale_words[kU][kSlices][kSliceN / 8];

    auto promote_unit = [&](int u) {  // u is a compile-time constant once the loops are unrolled
      const int j = u / kUnitsPerStage, sl = (u % kUnitsPerStage) / 2;
      [[maybe_unused]] const int gi = u % 2;
      FenceOperands(part[u % kSets]);
      if constexpr (kScaleMma) {
        FenceOperands(scale_products[u % kSets]);
        PromoteScaled<kSliceN>(acc[sl], part[u % kSets], scale_products[u % kSets]);
      } else if constexpr (C::kOffsetWeights) {
        PromoteOffset<C>(acc[sl], part[u % kSets], act_scales[j], sl, gi, t, sw[j][gi]);
      } else {
        Promote<C, OutT, kFp8Act>(acc[sl], part[u % kSets], act_scale_words[j][sl], gi, sw[j][gi]);
      }
      if (u % kUnitsPerStage == kUnitsPerStage - 1) release_main(stage[j]);
    };

#pragma unroll
    for (int j = 0; j < kU; ++j) {
      stage[j] = state.index;
      MbarWait(bar.Full(stage[j]), state.phase);
      state.Advance();
      if constexpr (kScaleMma) FenceProxyAsync();  // the scale wgmma reads what cp.async wrote
      const uint32_t wscales = smem + L::kWeightScales + stage[j] * L::Stride(kObjWeightScales);
      const uint32_t sw_word0 = Lds32(wscales + 4 * column);
      const uint32_t sw_word1 = Lds32(wscales + 4 * (column + 8));
#pragma unroll
      for (int gi = 0; gi < 2; ++gi) {
        if constexpr (kScaleMma) {
          const uint32_t keep = t == 0 ? (gi ? 0xFFFF0000u : 0x0000FFFFu) : 0u;
          sw_frag[j][gi][0] = sw_word0 & keep;
          sw_frag[j][gi][1] = sw_word1 & keep;
          sw_frag[j][gi][2] = 0;
          sw_frag[j][gi][3] = 0;
        } else {
          sw[j][gi][0] = GroupScale<OutT, false>(sw_word0, gi);
          sw[j][gi][1] = GroupScale<OutT, false>(sw_word1, gi);
        }
      }
      const uint32_t weights = smem + L::kWeights + stage[j] * L::Stride(kObjWeights);
      if constexpr (C::kExpandedWeights) {
        ExpandedFragments(weights + wg * kExpandedRowsBytes, warp % 4, lane, a[j]);
      } else {
        const uint32_t fragments = weights + wg * 2 * kWeightBlockBytes + 16 * tid;
        WeightFragments<C::kOffsetWeights>(Lds128(fragments), a[j][0]);
        WeightFragments<C::kOffsetWeights>(Lds128(fragments + kWeightBlockBytes), a[j][1]);
      }
      act_scales[j] = smem + L::kActScales + stage[j] * L::Stride(kObjActScales);
      if constexpr (!kScaleMma && !C::kOffsetWeights) {
#pragma unroll
        for (int sl = 0; sl < kSlices; ++sl) LoadActScaleWords<C>(act_scales[j], sl, t, act_scale_words[j][sl]);
      }
      const uint64_t desc_x =
          MakeSmemDesc(smem + L::kActivations + stage[j] * L::Stride(kObjActivations), 16, 8 * C::kTileK, kSwizzle128B);
#pragma unroll
      for (int v = 0; v < kUnitsPerStage; ++v) {
        const int u = j * kUnitsPerStage + v;
        const int sl = v / 2, gi = v % 2;
        if (!kScaleMma && u >= kSets) {
          WgmmaWaitPending(kSets - 1);
          promote_unit(u - kSets);
        }
        // Unit (sl, gi): tokens [sl kSliceN, +kSliceN), k [64 gi, 64 gi + 64) of the stage.
        const uint32_t offset = sl * kSliceN * C::kTileK + 64 * gi;
        FenceOperands(part[u % kSets]);
        if constexpr (kScaleMma) FenceOperands(scale_products[u % kSets]);
        WgmmaFence();
#pragma unroll
        for (int kk = 0; kk < 2; ++kk) {
          Wgmma<kSliceN>::E4m3(part[u % kSets], a[j][gi] + 4 * kk, desc_x + ((offset + 32 * kk) >> 4), kk);
        }
        if constexpr (kScaleMma) {
          // Unit u's scale products, in its partial's commit group. K-major, no swizzle: 8-token core matrices
          // 128 B apart; the k = 8..15 core matrix is read from the same rows (leading offset 0) and multiplied by
          // the zeros of sw_frag.
          const uint32_t rows = act_scales[j] + sl * kSliceN * C::kActScalePitch;
          Wgmma<kSliceN>::template Half<kBf16>(scale_products[u % kSets], sw_frag[j][gi],
                                               MakeSmemDesc(rows, 0, 8 * C::kActScalePitch, kSwizzleNone), /*scale_d=*/0);
        }
        WgmmaCommit();
        if constexpr (kScaleMma && kSets == 1) {  // one set: the unit is promoted once it retires
          WgmmaWaitPending(0);
          promote_unit(u);
        } else if (kScaleMma && u >= 1) {  // unit u - 1 is promoted while unit u's wgmmas run
          WgmmaWaitPending(1);
          promote_unit(u - 1);
        }
      }
    }
    if constexpr (kScaleMma) {
      if constexpr (kSets > 1) {
        WgmmaWaitPending(0);
        promote_unit(kUnits - 1);
      }
    } else {
#pragma unroll
      for (int u = kUnits - kSets; u < kUnits; ++u) {
        WgmmaWaitPending(kUnits - 1 - u);
        promote_unit(u);
      }
    }
  };

  // Stream-K partial slot of a CTA for this warpgroup: float4 f of thread t at f x 128 + t (coalesced);
  // accumulators acc[sl][i..i + 3] are float4 f = (sl x kSliceN / 2 + i) / 4.
  constexpr int kPartialFloat4s = kSlices * kSliceN / 8;
  auto partial_slot = [&](int cta) { return p.partials + (int64_t{cta} * 2 + wg) * (kConsumerThreads * kPartialFloat4s); };
  auto partial_offset = [&](int sl, int i) { return ((sl * kSliceN / 2 + i) / 4) * kConsumerThreads + tid; };

  Segment seg;
  for (bool more = FirstSegment<C>(p, seg); more; more = NextSegment<C>(p, seg)) {
    const Tile tile = TileAt<C>(seg.ct, p, cta_rank);
#pragma unroll
    for (int sl = 0; sl < kSlices; ++sl) {
#pragma unroll
      for (int i = 0; i < kSliceN / 2; ++i) acc[sl][i] = 0.0f;
    }

    // ---- main loop: steps of kStagesPerStep K-stages, then single stages for the remainder
    const int stages = seg.ks_end - seg.ks_begin;
    int ks = 0;
    for (; ks + C::kStagesPerStep <= stages; ks += C::kStagesPerStep) {
      main_step(std::integral_constant<int, C::kStagesPerStep>{});
    }
    if constexpr (C::kStagesPerStep > 1) {
      for (; ks < stages; ++ks) main_step(std::integral_constant<int, 1>{});
    }

    // ---- stream-K: a segment that does not finish its tile publishes its partial; the finishing segment
    // adds those of the CTAs that ran the rest of the tile, in CTA order (deterministic). They ran them
    // first in their ranges and never wait, so the wait below always ends.
    if (C::kStreamK && !FinishesTile(seg)) {
      float4* slot = partial_slot(blockIdx.x);
#pragma unroll
      for (int sl = 0; sl < kSlices; ++sl) {
#pragma unroll
        for (int i = 0; i < kSliceN / 2; i += 4) {
          slot[partial_offset(sl, i)] = make_float4(acc[sl][i], acc[sl][i + 1], acc[sl][i + 2], acc[sl][i + 3]);
        }
      }
      // The named barrier orders the warpgroup's stores before thread 0's release (cumulative): no
      // per-thread fence (__threadfence() is fence.sc.gpu in every thread).
      NamedBarrierSync(1 + wg, kConsumerThreads);
      if (tid == 0) StoreRelease(g_arrival_counters + 2 * blockIdx.x + wg, 1u);
      continue;
    }
    if (C::kStreamK && seg.ks_end < p.k_stages) {
      const int last_cta = OwnerOfIteration(p, (seg.ct + 1) * p.k_stages - 1);
      if (tid == 0) {
        for (int cta = blockIdx.x + 1; cta <= last_cta; ++cta) {
          uint32_t* const flag = g_arrival_counters + 2 * cta + wg;
          while (LoadAcquire(flag) == 0) __nanosleep(64);
          *flag = 0;  // re-armed for the next launch: no other CTA of this one reads or sets it again
        }
      }
      NamedBarrierSync(1 + wg, kConsumerThreads);
      for (int cta = blockIdx.x + 1; cta <= last_cta; ++cta) {
        const float4* slot = partial_slot(cta);
#pragma unroll
        for (int sl = 0; sl < kSlices; ++sl) {
#pragma unroll
          for (int i = 0; i < kSliceN / 2; i += 4) {
            const float4 v = __ldcg(slot + partial_offset(sl, i));
            acc[sl][i] += v.x;
            acc[sl][i + 1] += v.y;
            acc[sl][i + 2] += v.z;
            acc[sl][i + 3] += v.w;
          }
        }
      }
    }

    // ---- α, then the low-rank up projection, added to the accumulators
    float beta[2] = {0.0f, 0.0f};
    for (int item = 0; item < items; ++item) {
      const int s = lora_state.index;
      MbarWait(bar.LoraFull(s), lora_state.phase);
      MbarWait(bar.LoraConverted(s), lora_state.phase);
      if (item == 0) {
        const uint32_t affine = smem + L::kAlphaBeta + s * L::Stride(kObjAlphaBeta);
        // Offset weights (decode) carry 2^-9 in their codes: 2^9 joins α (exact, a power of two).
        constexpr float kCodeScale = C::kOffsetWeights ? 512.0f : 1.0f;
        if (C::kOffsetWeights || p.alpha != nullptr) {
          float alpha0 = kCodeScale;
          float alpha1 = kCodeScale;
          if (p.alpha != nullptr) {
            alpha0 *= __uint_as_float(Lds32(affine + 4 * column));
            alpha1 *= __uint_as_float(Lds32(affine + 4 * (column + 8)));
          }
#pragma unroll
          for (int sl = 0; sl < kSlices; ++sl) {
#pragma unroll
            for (int i = 0; i < kSliceN / 2; ++i) acc[sl][i] *= (i & 2) ? alpha1 : alpha0;
          }
        }
        if (p.bias != nullptr) {
          const uint32_t bias = affine + C::kAlphaBytes;
          beta[0] = HalfBitsToFloat<OutT>(Lds16(bias + 2 * column));
          beta[1] = HalfBitsToFloat<OutT>(Lds16(bias + 2 * (column + 8)));
        }
      }
      if (p.rank > 0) {
        // A = L_upᵀ (64 columns x 16 ranks per k-step, MN-major, 128-byte swizzle: 8-rank groups 1024 B
        // apart); B = the converted LA (tokens x 16 ranks, K-major). With scale products the wgmmas accumulate
        // into a fresh partial set that is then added to acc, as the main loop promotes its groups: acc is then
        // never a wgmma accumulator and ptxas may place it in any registers (as the low-rank wgmmas' accumulator,
        // or copied into a partial set for them, it left the 128-token tile no registers for its second product
        // set: C7512); the other tiles accumulate into acc (16 tokens: 0.3 us slower through a partial set).
        // Always the whole chunk: the ranks past `rank` are zero in both operands (TMA zero fill), and a runtime
        // trip count would put descriptor arithmetic between wgmmas, which makes ptxas serialize every wgmma.
        const uint64_t desc_a = MakeSmemDesc(smem + L::kLoraUp + s * L::Stride(kObjLoraUp) + wg * C::kLoraChunk * 128,
                                             1024, 1024, kSwizzle128B);
        const uint64_t desc_b =
            MakeSmemDesc(smem + L::kLaHalf + s * L::Stride(kObjLaHalf), 16, 8 * C::kLaRowBytes, C::kLaSwizzle);
        auto lowrank = [&](int sl) -> float(&)[kSliceN / 2] {
          if constexpr (kScaleMma) return part[sl % kLowRankSlices];
          else return acc[sl];
        };
#pragma unroll
        for (int first = 0; first < kSlices; first += kLowRankSlices) {
#pragma unroll
          for (int sl = first; sl < first + kLowRankSlices; ++sl) {
            if constexpr (kScaleMma) {
#pragma unroll
              for (int i = 0; i < kSliceN / 2; ++i) part[sl % kLowRankSlices][i] = 0.0f;
            }
            FenceOperands(lowrank(sl));
          }
          WgmmaFence();
#pragma unroll
          for (int kk = 0; kk < C::kLoraChunk / 16; ++kk) {
#pragma unroll
            for (int sl = first; sl < first + kLowRankSlices; ++sl) {
              Wgmma<kSliceN>::template Half<kBf16>(lowrank(sl), desc_a + ((kk * 16 * 128) >> 4),
                                                    desc_b + ((sl * kSliceN * C::kLaRowBytes + kk * 32) >> 4));
            }
          }
          WgmmaCommit();
          WgmmaWait<0>();
#pragma unroll
          for (int sl = first; sl < first + kLowRankSlices; ++sl) {
            FenceOperands(lowrank(sl));
            if constexpr (kScaleMma) {
#pragma unroll
              for (int i = 0; i < kSliceN / 2; ++i) acc[sl][i] += part[sl % kLowRankSlices][i];
            }
          }
        }
      }
      __syncwarp();
      if (lane == 0) MbarArrive(bar.LoraEmpty(s));
      lora_state.Advance();
    }

    // ---- epilogue: + β, stmatrix (transposed: token rows of 64 columns, 128-byte swizzle), TMA store, kStagedTokens
    // tokens at a time (the 256-token tile in two)
#pragma unroll
    for (int pass = 0; pass < C::kTileM / C::kStagedTokens; ++pass) {
      if (tid == 0) BulkWaitRead0();  // the previous store has read the staging tile
      NamedBarrierSync(1 + wg, kConsumerThreads);
      if constexpr (C::kTileM == 8) {
        // One token block: matrix j = column half j of tokens 0-7; lanes 0-15 give the row addresses.
        const float* d = acc[0];
        const uint32_t r0 = PackHalf2<OutT>(d[0] + beta[0], d[1] + beta[0]);
        const uint32_t r1 = PackHalf2<OutT>(d[2] + beta[1], d[3] + beta[1]);
        const int token = lane & 7;
        const int chunk = 2 * warp + ((lane >> 3) & 1);
        StMatrixX2Trans(staging + token * 128 + ((chunk ^ token) << 4), r0, r1);
      }
#pragma unroll
      for (int pair = 0; pair < C::kStagedTokens / 16; ++pair) {
        const int tile_pair = pass * C::kStagedTokens / 16 + pair;
        const int sl = tile_pair * 16 / kSliceN;
        const int i = tile_pair * 16 % kSliceN / 8;  // token blocks i, i + 1 of the slice
        const float* d = acc[sl];
        const uint32_t r0 = PackHalf2<OutT>(d[4 * i + 0] + beta[0], d[4 * i + 1] + beta[0]);
        const uint32_t r1 = PackHalf2<OutT>(d[4 * i + 2] + beta[1], d[4 * i + 3] + beta[1]);
        const uint32_t r2 = PackHalf2<OutT>(d[4 * i + 4] + beta[0], d[4 * i + 5] + beta[0]);
        const uint32_t r3 = PackHalf2<OutT>(d[4 * i + 6] + beta[1], d[4 * i + 7] + beta[1]);
        // Lane L gives row L % 8 of matrix L / 8: matrix j = (column half j & 1, token block j >> 1).
        const int j = lane >> 3;
        const int token = 16 * pair + 8 * (j >> 1) + (lane & 7);
        const int chunk = 2 * warp + (j & 1);
        StMatrixX4Trans(staging + token * 128 + ((chunk ^ (token & 7)) << 4), r0, r1, r2, r3);
      }
      FenceProxyAsync();
      NamedBarrierSync(1 + wg, kConsumerThreads);
      const int m0 = tile.m0 + pass * C::kStagedTokens;
      if (tid == 0 && tile.valid && m0 < p.m) {
        TmaStore2d(tm_y, staging, tile.n0 + 64 * wg, m0);  // clips the token rows >= M
        BulkCommit();
      }
    }
  }
  if (tid == 0) BulkWait0();
}

template <int kShapeIndex, class OutT, bool kFp8Act>
__global__ void __launch_bounds__(kThreads, Config<kShapeIndex>::kCtasPerSm)
    W4A4GemmKernel(const __grid_constant__ CUtensorMap tm_w, const __grid_constant__ CUtensorMap tm_x,
                   const __grid_constant__ CUtensorMap tm_records, const __grid_constant__ CUtensorMap tm_la,
                   const __grid_constant__ CUtensorMap tm_up, const __grid_constant__ CUtensorMap tm_y,
                   const __grid_constant__ KernelParams p) {
  using C = Config<kShapeIndex>;
  using L = Smem<C>;
  extern __shared__ uint8_t smem_raw[];
  // The swizzled regions need a 1024-byte aligned base (the plan's total + 1 KB of slack is allocated).
  const uint32_t smem = tma::SwizzledSharedBase(smem_raw);
  const Barriers<C> bar{smem + static_cast<uint32_t>(L::kBarriers)};
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const uint32_t cta_rank = C::kCluster > 1 ? ptx::ClusterCtaRank() : 0;

  if (threadIdx.x == 0) {
    for (int s = 0; s < C::kStages; ++s) {
      MbarInit(bar.Full(s), C::kMainFullArrivals);
      MbarInit(bar.Empty(s), C::kMainEmptyArrivals);
    }
    for (int s = 0; s < C::kLoraStages; ++s) {
      MbarInit(bar.LoraFull(s), C::kLoraFullArrivals);
      MbarInit(bar.LoraConverted(s), C::kLoraConvertedArrivals);
      MbarInit(bar.LoraEmpty(s), C::kLoraEmptyArrivals);
    }
    tma::FenceMbarInit();
  }
  if constexpr (kUsesScaleProducts<C, kFp8Act>) {
    // The scale wgmma reads whole 16-byte token rows of the activation-scale buffers; cp.async fills only the
    // first 4 bytes, so the rest is zeroed once here (and made visible to the async proxy).
    for (int i = threadIdx.x; i < Smem<C>::Footprint(kObjActScales) / 16; i += kThreads) {
      Sts128(smem + static_cast<uint32_t>(L::kActScales) + 16 * i, uint4{0, 0, 0, 0});
    }
    FenceProxyAsync();
  }
  __syncthreads();
  if constexpr (C::kCluster > 1) ptx::ClusterSync();  // the peer's barriers exist before any multicast or arrive

  if (warp < 4) {
    ptx::SetMaxRegistersDec<kProducerRegisters>();
    if (warp == 0) {
      if (lane == 0) {
        TmaPrefetch(tm_w);
        TmaPrefetch(tm_x);
        if constexpr (C::kRecordsByTma) TmaPrefetch(tm_records);
      }
      ProduceMain<C>(tm_w, tm_x, tm_records, p, smem, bar, cta_rank, lane);
    } else if (warp == 1) {
      if (lane == 0 && p.rank > 0) {
        TmaPrefetch(tm_up);
        TmaPrefetch(tm_la);
      }
      ProduceLowRank<C>(tm_up, tm_la, p, smem, bar, cta_rank, lane);
    } else {
      ConvertLowRank<C, OutT>(p, smem, bar, threadIdx.x - 64, lane);
    }
  } else {
    ptx::SetMaxRegistersInc<C::kConsumerRegisters>();
    Consume<C, OutT, kFp8Act>(tm_y, p, smem, bar, cta_rank, warp / 4 - 1, threadIdx.x % 128);
  }
  // No CTA leaves while its peer may still multicast into it or arrive on its barriers.
  if constexpr (C::kCluster > 1) ptx::ClusterSync();
}

// Decode tiles without act_quant's promotion records (the GEMM called on its own): one thread per token and group,
// from the group's codes (q_x is (m, k) row-major, so group i of the (m, k/64) records is codes [64 i, 64 i + 64))
// and its scale (the 4-byte word i / 2 of s_x: two 16-bit scales, or the fp32 scale of 128), with act_quant's
// functions (common/promotion_records.h), so the same bits.
template <class OutT, bool kFp8Act>
__global__ void __launch_bounds__(256) PromotionRecordsKernel(const uint4* __restrict__ q_x,
                                                              const uint32_t* __restrict__ s_x,
                                                              float2* __restrict__ records, int64_t count) {
  ptx::LaunchDependents();  // the GEMM, launched next with programmatic dependent launch, starts and sets up
  const int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x;
  if (i >= count) return;
  float sum = 0.0f;
#pragma unroll
  for (int c = 0; c < 4; ++c) sum += SumE4m3x16(q_x[4 * i + c]);
  records[i] = PromotionRecord(sum, GroupScale<OutT, kFp8Act>(s_x[i / 2], static_cast<int>(i % 2)));
}

// ---------------------------------------------------------------------------------------------------
// Host side.

bool Aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

template <int kShapeIndex, class OutT, bool kFp8Act>
cudaError_t LaunchShape(const W4A4GemmSm90Args& args, cudaStream_t stream) {
  using C = Config<kShapeIndex>;
  const auto kernel = W4A4GemmKernel<kShapeIndex, OutT, kFp8Act>;
  const int m = static_cast<int>(args.m);
  const int n = static_cast<int>(args.n);
  const int k = static_cast<int>(args.k);
  const int rank = static_cast<int>(args.rank);

  CUtensorMap tm_w{}, tm_x{}, tm_records{}, tm_la{}, tm_up{}, tm_y{};
  const CUtensorMapDataType half = std::is_same_v<OutT, __nv_bfloat16> ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16
                                                                      : CU_TENSOR_MAP_DATA_TYPE_FLOAT16;
  bool ok;
  if constexpr (C::kExpandedWeights) {
    // Expanded e4m3 weights in the workspace, written by ExpandWeightsKernel right before the GEMM.
    if (args.workspace == nullptr || args.workspace_bytes < W4A4ExpandedWeightsBytes(n, k) ||
        !Aligned16(args.workspace)) {
      return cudaErrorInvalidValue;
    }
    auto* expanded = static_cast<uint8_t*>(args.workspace);
    const auto blocks = static_cast<unsigned>(int64_t{n / 64} * (k / kExpandTileK));
    ExpandWeightsKernel<<<blocks, kConsumerThreads, 0, stream>>>(reinterpret_cast<const uint4*>(args.qweight),
                                                                 expanded, k);
    if (cudaError_t status = cudaGetLastError(); status != cudaSuccess) return status;
    ok = EncodeTiled<2>(&tm_w, CU_TENSOR_MAP_DATA_TYPE_UINT8, expanded, {uint64_t(k), uint64_t(n)}, {uint64_t(k)},
                        {uint32_t(C::kTileK), uint32_t(C::kTileN)}, CU_TENSOR_MAP_SWIZZLE_128B);
  } else {
    // Prepacked weights as (256 x u64 per 64 x 64 block, k/64, n/64); a stage is 2 x 2 blocks.
    ok = EncodeTiled<3>(&tm_w, CU_TENSOR_MAP_DATA_TYPE_UINT64, args.qweight,
                        {kWeightBlockBytes / 8, uint64_t(k / 64), uint64_t(n / 64)},
                        {kWeightBlockBytes, uint64_t(k / 64) * kWeightBlockBytes}, {kWeightBlockBytes / 8, 2, 2},
                        CU_TENSOR_MAP_SWIZZLE_NONE);
  }
  ok = ok && EncodeTiled<2>(&tm_x, CU_TENSOR_MAP_DATA_TYPE_UINT8, args.q_x, {uint64_t(k), uint64_t(m)}, {uint64_t(k)},
                            {uint32_t(C::kTileK), uint32_t(C::kHalfRows)}, CU_TENSOR_MAP_SWIZZLE_128B);
  ok = ok && EncodeTiled<2>(&tm_y, half, args.y, {uint64_t(n), uint64_t(m)}, {uint64_t(n) * 2},
                            {64, uint32_t(C::kStagedTokens)}, CU_TENSOR_MAP_SWIZZLE_128B);
  if (rank > 0) {
    ok = ok && EncodeTiled<2>(&tm_la, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, args.la, {uint64_t(rank), uint64_t(m)},
                              {uint64_t(rank) * 4}, {uint32_t(C::kLoraChunk), uint32_t(C::kHalfRows)},
                              CU_TENSOR_MAP_SWIZZLE_NONE);
    ok = ok && EncodeTiled<2>(&tm_up, half, args.lora_up, {uint64_t(n), uint64_t(rank)}, {uint64_t(n) * 2},
                              {64, uint32_t(C::kLoraChunk)}, CU_TENSOR_MAP_SWIZZLE_128B);
  }
  if (!ok) return cudaErrorInvalidValue;

  KernelParams p{};
  p.s_x = static_cast<const uint8_t*>(args.s_x);
  bool records_launched = false;
  if constexpr (C::kOffsetWeights) {
    const int64_t offset = W4A4PromotionRecordsOffset(m, n, k, args.num_sms);
    if (args.workspace == nullptr || !Aligned16(args.workspace) ||
        args.workspace_bytes < offset + W4A4PromotionRecordsBytes(m, k)) {
      return cudaErrorInvalidValue;
    }
    auto* records = reinterpret_cast<float2*>(static_cast<uint8_t*>(args.workspace) + offset);
    p.promotion_records = records;
    // (m, k/64) records as (m, k/32) fp32: a stage's box is 4 floats (its two records) x the tile's tokens.
    if (C::kRecordsByTma &&
        !EncodeTiled<2>(&tm_records, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, records, {uint64_t(k / 32), uint64_t(m)},
                        {uint64_t(k / 8)}, {4, uint32_t(C::kTileM)}, CU_TENSOR_MAP_SWIZZLE_NONE)) {
      return cudaErrorInvalidValue;
    }
    if (!args.promotion_records_written) {
      // The GEMM's loads wait for this kernel's end (griddepcontrol.wait), not for act_quant's token handoff.
      if (args.act_quant_ctas > 0) return cudaErrorInvalidValue;
      const int64_t count = int64_t{m} * (k / kW4A4WeightGroup);
      PromotionRecordsKernel<OutT, kFp8Act><<<static_cast<unsigned>((count + 255) / 256), 256, 0, stream>>>(
          reinterpret_cast<const uint4*>(args.q_x), static_cast<const uint32_t*>(args.s_x), records, count);
      if (cudaError_t status = cudaGetLastError(); status != cudaSuccess) return status;
      records_launched = true;
    }
  }
  p.wscales = static_cast<const uint8_t*>(args.wscales);
  p.alpha = args.alpha;
  p.bias = args.bias;
  p.m = m;
  p.n = n;
  p.k = k;
  p.rank = rank;
  p.k_stages = k / C::kTileK;
  p.m_tiles = (m + C::kTileM - 1) / C::kTileM;
  p.n_tiles = n / C::kTileN;
  p.n_groups = (p.n_tiles + C::kCluster - 1) / C::kCluster;
  const int64_t cluster_tiles = int64_t{p.m_tiles} * p.n_groups;
  if (cluster_tiles > INT32_MAX) return cudaErrorInvalidValue;
  p.cluster_tiles = static_cast<int>(cluster_tiles);

  // Per call: the attribute belongs to the current device's context (a host call, no stream work).
  const cudaError_t attribute_status =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(C::kSmemBytes));
  if (attribute_status != cudaSuccess) return attribute_status;

  cudaLaunchAttribute attributes[2]{};
  attributes[0].id = cudaLaunchAttributeClusterDimension;
  attributes[0].val.clusterDim.x = C::kCluster;
  attributes[0].val.clusterDim.y = 1;
  attributes[0].val.clusterDim.z = 1;
  attributes[1].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attributes[1].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config{};
  config.blockDim = dim3(kThreads);
  config.dynamicSmemBytes = C::kSmemBytes;
  config.stream = stream;
  config.attrs = attributes;
  config.numAttrs = 1;  // the occupancy query below sees the cluster only

  // Persistent grid: as many clusters as can be resident at once (asked once per kernel: the devices
  // of a process are assumed alike), capped by the work.
  static const int resident_clusters = [&] {
    int clusters = 0;
    config.gridDim = dim3(C::kCluster);
    if (cudaOccupancyMaxActiveClusters(&clusters, kernel, &config) != cudaSuccess || clusters <= 0) {
      cudaGetLastError();  // the failed query must not surface as a later launch's error; use the SM count
      int sms = 0;
      if (CurrentDeviceSms(sms) != cudaSuccess) cudaGetLastError();  // as above; sms stays 0
      clusters = sms / C::kCluster;
    }
    return std::max(clusters, 1);
  }();
  int clusters = std::min(resident_clusters, p.cluster_tiles);
  if constexpr (C::kStreamK) {
    // Stream-K over the CTAs the workspace was planned for (and that are resident at once: the finishing
    // segments wait for partials of other CTAs).
    const int ctas = std::min(resident_clusters, args.num_sms * C::kCtasPerSm);
    if (W4A4UsesStreamK(m, n, k, ctas) && args.workspace_bytes >= W4A4StreamKWorkspaceBytes(C::kTileM, ctas)) {
      p.partials = static_cast<float4*>(args.workspace);
      p.iterations = p.cluster_tiles * p.k_stages;
      clusters = ctas;
    }
  }
  config.gridDim = dim3(clusters * C::kCluster);
  p.act_quant_ctas = args.act_quant_ctas;
  config.numAttrs = (args.after_act_quant || records_launched) && !C::kExpandedWeights ? 2 : 1;
  return cudaLaunchKernelEx(&config, kernel, tm_w, tm_x, tm_records, tm_la, tm_up, tm_y, p);
}

// The instance of a launch (W4A4LaunchShapeIndex, in the plan's kW4A4Shapes order): token tiles of 8, 16, 32, 64 or
// 128 (cluster 2), and from kW4A4ExpandedWeightsMinTokens the 128- or (int4/uint4 activations) 256-token tile on
// expanded weights.
template <class OutT, bool kFp8Act>
cudaError_t LaunchForTokens(const W4A4GemmSm90Args& args, cudaStream_t stream) {
  switch (W4A4LaunchShapeIndex(args.m, args.n, args.num_sms, kFp8Act)) {
    case 0:
      return LaunchShape<0, OutT, kFp8Act>(args, stream);
    case 1:
      return LaunchShape<1, OutT, kFp8Act>(args, stream);
    case 2:
      return LaunchShape<2, OutT, kFp8Act>(args, stream);
    case 3:
      return LaunchShape<3, OutT, kFp8Act>(args, stream);
    case 4:
      return LaunchShape<4, OutT, kFp8Act>(args, stream);
    case 5:
      return LaunchShape<5, OutT, kFp8Act>(args, stream);
    default:  // never with fp8 activations (W4A4LaunchShapeIndex), so that instance is not built
      if constexpr (kFp8Act) {
        return cudaErrorInvalidValue;
      } else {
        return LaunchShape<6, OutT, kFp8Act>(args, stream);
      }
  }
}

static_assert(kW4A4ShapeCount == 7 && kW4A4Shapes[0].tile_m == 8 && kW4A4Shapes[1].tile_m == 16 &&
                  kW4A4Shapes[2].tile_m == 32 && kW4A4Shapes[3].tile_m == 64 && kW4A4Shapes[4].tile_m == 128 &&
                  !kW4A4Shapes[4].expanded_weights && kW4A4ExpandedShape == 5 && kW4A4ExpandedWideShape == 6,
              "LaunchForTokens names the plan's shapes: token tiles by size, then the two on expanded weights");

}  // namespace

const char* CheckW4A4GemmSm90Shape(int64_t m, int64_t n, int64_t k, int64_t rank) {
  if (n <= 0 || n % 128) return "N must be a positive multiple of 128";
  if (k <= 0 || k % 128) return "K must be a positive multiple of 128";
  if (rank < 0 || rank % 16 || rank > kMaxRank) return "the low-rank rank must be a multiple of 16 in [0, 256]";
  if (m < 0 || m >= (int64_t{1} << 31) || n >= (int64_t{1} << 31) || k >= (int64_t{1} << 31)) {
    return "M, N and K must be below 2^31";
  }
  return nullptr;
}

cudaError_t LaunchW4A4GemmSm90(const W4A4GemmSm90Args& args, cudaStream_t stream) {
  if (CheckW4A4GemmSm90Shape(args.m, args.n, args.k, args.rank) != nullptr || args.num_sms < 1 ||
      args.num_sms > kMaxNumSms) {
    return cudaErrorInvalidValue;
  }
  if (args.m == 0) return cudaSuccess;
  const bool rank_ok = args.rank == 0 || (Aligned16(args.la) && Aligned16(args.lora_up));
  if (!Aligned16(args.q_x) || !Aligned16(args.qweight) || !Aligned16(args.y) || !rank_ok ||
      (args.alpha != nullptr && !Aligned16(args.alpha)) || (args.bias != nullptr && !Aligned16(args.bias)) ||
      (reinterpret_cast<uintptr_t>(args.s_x) & 3) || (reinterpret_cast<uintptr_t>(args.wscales) & 3)) {
    return cudaErrorInvalidValue;
  }
  const bool fp8 = args.act_format == ActFormat::kFp8;
  if (args.out_type == HalfType::kBf16) {
    return fp8 ? LaunchForTokens<__nv_bfloat16, true>(args, stream)
               : LaunchForTokens<__nv_bfloat16, false>(args, stream);
  }
  return fp8 ? LaunchForTokens<__half, true>(args, stream) : LaunchForTokens<__half, false>(args, stream);
}

int64_t W4A4GemmArmedCounters() { return ArmedArrivalCounters(); }

uint32_t* W4A4GemmTokensReadyCounter(cudaError_t& status) {
  void* pool = nullptr;
  status = cudaGetSymbolAddress(&pool, g_arrival_counters);
  return status == cudaSuccess ? static_cast<uint32_t*>(pool) + kW4A4TokensReadyCounter : nullptr;
}

}  // namespace jax_w4a4::sm90
