// The routed experts' backward (backward_job.h): one task per (NUMA group, expert) gathers the
// expert's rows and runs GEMMs over all of them (gate/up recomputed, dA = dY W_down,
// dx = [dg, du] W_gate_up), writing per-slot partial dx and dweights; a second phase sums each
// token's slots and groups. fp32 math: fp32 GEMMs on weight panels unpacked once per pass.
// bf16 math: the forward's kernels (AMX tiles from amx_min_tokens rows, else AVX-512) on bf16
// activations, the transposed products on panels of W repacked transposed as bf16 n-blocks.
#include "moe/backward_job.h"

#include <algorithm>
#include <cstring>
#include <vector>

#include "kernels/grad.h"
#include "layout/bf16.h"
#include "moe/act_store.h"
#include "moe/call_plan.h"
#include "moe/routing.h"

namespace hetmoe {
namespace {

// Depth of a weight panel: 2 n-blocks x 256 k (or 256 rows x 32 k) fp32 = 32 KiB, in L1.
constexpr int kPanelDepth = 256;

const GradKernels& grad_kernels(Isa isa) {
  if (isa >= Isa::kAvx512) return avx512_grad_kernels();
  if (isa == Isa::kAvx2) return avx2_grad_kernels();
  return reference_grad_kernels();
}

// Group g's matrices of expert e in the layer's mapping (moe_layer.cpp shape_expert's shapes).
void expert_matrices(const MoELayer& l, int g, int e, PackedMatrix& gu, PackedMatrix& dn) {
  const MoEConfig& c = l.config();
  const bool quant = c.format != WeightFormat::kBF16;
  const int unit = quant ? std::max(kPadK, c.group_size) : kPadK;
  for (PackedMatrix* m : {&gu, &dn}) {
    m->format = c.format;
    m->group_size = c.group_size;
  }
  const int s = l.slice_begin(g + 1) - l.slice_begin(g);
  gu.n = 2 * s;
  gu.k = int(round_up(c.hidden, unit));
  dn.n = int(round_up(c.hidden, kBlockN));
  dn.k = s;
  uint8_t* mem = const_cast<uint8_t*>(l.group_memory(g)) + size_t(e) * l.group_expert_bytes(g);
  place_packed(gu, mem);
  place_packed(dn, mem + l.group_down_offset(g));
}

// Per-task buffers, reused by each worker's later tasks: rows of m tokens, each row padded by 16
// floats past its width (row strides of a multiple of 4 KiB would map the tile's rows onto one
// L1 set).
struct Scratch {
  size_t ldx = 0, ldy = 0, ldc = 0, ldh = 0;
  std::vector<float> x, dy, c, h, sig, da, dx, y, panel;
  // m: rows, 16-aligned for the forward kernels (they write round_up(m, 16) rows). dY rows are
  // zero to hn rounded to 64 (the K of W_down^T's panels).
  void size(int m, int hp, int hn, int s, bool grad, bool want_y) {
    ldx = hp + 16, ldy = round_up(hn, 64) + 16, ldc = 2 * s + 16, ldh = s + 16;
    x.resize(size_t(m) * ldx);
    c.resize(size_t(m) * ldc);
    h.resize(size_t(m) * ldh);
    sig.resize(size_t(m) * ldh);
    dy.resize(grad ? size_t(m) * ldy : 0);
    da.resize(grad ? size_t(m) * ldh : 0);
    dx.resize(grad ? size_t(m) * ldx : 0);
    y.resize(want_y ? size_t(m) * ldy : 0);
    panel.resize(size_t(kPanelDepth) * 2 * kBlockN);
  }
};

// c[i][n] = a_i . W[n] for every n of w (a rows of w.k, lda apart): panels of two n-blocks'
// columns over kPanelDepth k, each unpacked once and run over all m rows.
void times_wt(const GradKernels& kern, const PackedMatrix& w, const float* a, size_t lda, int m,
              float* c, size_t ldc, float* panel) {
  const int nblocks = w.n / kBlockN;
  for (int nb = 0; nb < nblocks; nb += 2) {
    const int cols = std::min(2, nblocks - nb) * kBlockN;
    for (int k0 = 0; k0 < w.k; k0 += kPanelDepth) {
      const int k1 = std::min(w.k, k0 + kPanelDepth);
      for (int j = 0; j < cols / kBlockN; ++j)
        kern.unpack_cols(w, nb + j, k0, k1, panel + j * kBlockN, size_t(cols));
      kern.gemm(m, k1 - k0, a + k0, lda, panel, cols, c + nb * kBlockN, ldc, k0 > 0);
    }
  }
}

// c[i][k] = sum_n a_i[n] W[n, k] for every k of w (a rows of w.n, lda apart): panels of 32 k
// over kPanelDepth rows of W.
void times_w(const GradKernels& kern, const PackedMatrix& w, const float* a, size_t lda, int m,
             float* c, size_t ldc, float* panel) {
  constexpr int kCols = 2 * kBlockN;
  for (int k0 = 0; k0 < w.k; k0 += kCols)
    for (int r0 = 0; r0 < w.n; r0 += kPanelDepth) {
      const int r1 = std::min(w.n, r0 + kPanelDepth);
      for (int nb = r0 / kBlockN; nb < r1 / kBlockN; ++nb)
        kern.unpack_rows(w, nb, k0, k0 + kCols, panel + size_t(nb * kBlockN - r0) * kCols,
                         kCols);
      kern.gemm(m, r1 - r0, a + r0, lda, panel, kCols, c + k0, ldc, r0 > 0);
    }
}

// c holds [gate block b, up block b] pairs of 16 columns. Forward: h = silu(g) * u, sig =
// sigmoid(g). dA = dY W_down is d loss / d h before the routing weight: dh = w dA, and
// dweights = <dY, W_down h> = <dA, h>. Then c becomes the gradient of its columns:
// dg = dh * u * sig * (1 + g (1 - sig)), du = dh * g * sig.
void silu_backward(Scratch& s, int m, int sl, const float* row_w, float* dws) {
  for (int i = 0; i < m; ++i) {
    const float* da = s.da.data() + size_t(i) * s.ldh;
    const float* h = s.h.data() + size_t(i) * s.ldh;
    const float* sig = s.sig.data() + size_t(i) * s.ldh;
    float dw = 0.0f;
    for (int j = 0; j < sl; ++j) dw += da[j] * h[j];
    dws[i] = dw;
    for (int b = 0; b < sl / 16; ++b) {
      float* gate = s.c.data() + size_t(i) * s.ldc + b * 32;
      float* up = gate + 16;
      for (int l = 0; l < 16; ++l) {
        const int j = b * 16 + l;
        const float g = gate[l], u = up[l], dh = row_w[i] * da[j];
        gate[l] = dh * u * sig[j] * (1.0f + g * (1.0f - sig[j]));
        up[l] = dh * g * sig[j];
      }
    }
  }
}

struct GradPlan {
  const MoELayer* layer;
  const MoEGradCall* call;
  const GradKernels* kern;
  Routing routing;
  bool bf16_math = false;
  int groups = 0, hidden = 0;
  // Per-slot partials (slot_arena); only slots of routed rows in groups with a slice are
  // written, and only those are read.
  float* dx_slots = nullptr;  // [G][q k][H]
  float* dw_slots = nullptr;  // [G][q k]
  float* y_slots = nullptr;   // [G][q k][H] with call.out: each slot's expert output
};

// The calling thread's memory for per-slot partials, kept across calls: a fresh vector per call
// (over 100 MB for 2048 tokens of top-8 at H = 2048) cost its page faults and a one-thread zero
// fill every time. Never zeroed: combine_token reads only what the expert tasks wrote.
float* slot_arena(int which, size_t floats) {
  thread_local std::vector<float> buf[3];
  if (buf[which].size() < floats) buf[which].resize(floats);
  return buf[which].data();
}

// Gathers expert a's rows (x, dY) into s: x zero-padded to gate/up's K, dY to down's N.
void gather(const GradPlan& p, int a, int hp, int hn, Scratch& s) {
  const MoEGradCall& c = *p.call;
  const int m = p.routing.rows[a], H = p.hidden;
  const long first = p.routing.first_row[a];
  for (int i = 0; i < m; ++i) {
    const int t = p.routing.row_token[first + i];
    float* xr = s.x.data() + size_t(i) * s.ldx;
    if (c.x_type == DType::kFP32) {
      std::memcpy(xr, static_cast<const float*>(c.x) + size_t(t) * H, sizeof(float) * H);
    } else {
      const uint16_t* xb = static_cast<const uint16_t*>(c.x) + size_t(t) * H;
      for (int j = 0; j < H; ++j) xr[j] = bf16_to_float(xb[j]);
    }
    std::fill(xr + H, xr + hp, 0.0f);
    if (!c.dy) continue;
    float* dyr = s.dy.data() + size_t(i) * s.ldy;
    std::memcpy(dyr, c.dy + size_t(t) * H, sizeof(float) * H);
    std::fill(dyr + H, dyr + round_up(hn, 64), 0.0f);
  }
}

// bf16 math: the forward kernels of an expert of m rows and their activations' form.
struct Bf16Math {
  const IsaKernels* kernels;
  const Epilogue* epilogue;
  bool tiled;     // AMX: activations in tile order (act_store.h)
  int group_size; // u8 activations' group (int formats' recompute), else 0
};

// `bytes` of `buf` (a per-thread buffer, grown as needed) from a 64-byte boundary.
uint8_t* aligned64(std::vector<uint8_t>& buf, size_t bytes) {
  buf.resize(bytes + 64);
  return reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(buf.data()) + 63) &
                                    ~uintptr_t(63));
}

// 64-byte aligned activations of rows x k in the forward kernels' input form (act_store.h),
// from per-thread memory (`slot` keeps the call's stores apart).
ActStore activations(int slot, int rows, size_t k, int group_size) {
  thread_local std::vector<uint8_t> act[4];
  thread_local std::vector<float> groups[4];
  const size_t ngroups = group_size ? k / group_size : 0, elem = group_size ? 1 : 2;
  groups[slot].resize(3 * size_t(rows) * ngroups);
  ActStore st;
  st.act = aligned64(act[slot], size_t(rows) * k * elem);
  st.groups = groups[slot].data();
  st.k = k;
  st.total = size_t(rows);
  st.ngroups = ngroups;
  st.elem = elem;
  return st;
}

// The first m rows of fp32 `src` (ld apart, k columns) as activations, rows m .. round_up(m,
// 16) zero: the forward kernels read those.
ActView put_rows(const Bf16Math& bm, int slot, const float* src, size_t ld, int m, size_t k,
                 int group_size) {
  const int mp = int(round_up(m, 16)), gs = group_size ? group_size : int(k);
  ActStore st = activations(slot, mp, k, group_size);
  for (int i = 0; i < m; ++i)
    st.put(*bm.epilogue, i, 0, src + size_t(i) * ld, int(k), gs, bm.tiled);
  for (int i = m; i < mp; ++i) st.zero(i, 0, k, gs, bm.tiled);
  return st.view(0, m, bm.tiled);
}

// c[i][j] = sum_r a_i[r] W[r, j] for every column j of w: per 64 columns (a whole k-block of
// int8, two of bf16), the panel of W^T (kernels/grad.h pack_transposed, 32 columns a call) times
// a's bf16 rows by the forward's bf16 GEMM.
void times_w_bf16(const GradKernels& kern, const Bf16Math& bm, const PackedMatrix& w,
                  const ActView& a, float* c, size_t ldc) {
  PackedMatrix t;
  t.format = WeightFormat::kBF16;
  t.n = 4 * kBlockN;
  t.k = int(round_up(size_t(w.n), 64));
  thread_local std::vector<uint8_t> mem;
  t.blocks = aligned64(mem, size_t(t.n) * t.k * 2);
  for (int k0 = 0; k0 < w.k; k0 += 4 * kBlockN) {  // w.k: a multiple of 64
    kern.pack_transposed(w, k0, t.blocks);
    kern.pack_transposed(w, k0 + 2 * kBlockN, t.n_block(2));
    bm.kernels->bf16(t, a, 0, 4, c + k0, ldc);
  }
}

void bf16_expert(const GradPlan& p, const Bf16Math& bm, const PackedMatrix& gu,
                 const PackedMatrix& dn, int m, const float* row_w, float* dw, Scratch& s) {
  const GradKernels& kern = *p.kern;
  const WeightFormat f = gu.format;
  const int sl = dn.k;
  const ActView x = put_rows(bm, 0, s.x.data(), s.ldx, m, gu.k, bm.group_size);
  bm.kernels->get(f)(gu, x, 0, gu.n / kBlockN, s.c.data(), s.ldc);  // [m, 2S]
  for (int i = 0; i < m; ++i)
    kern.silu(s.c.data() + i * s.ldc, sl, s.h.data() + i * s.ldh, s.sig.data() + i * s.ldh);
  if (!s.y.empty()) {
    const ActView h = put_rows(bm, 1, s.h.data(), s.ldh, m, sl, bm.group_size);
    bm.kernels->get(f)(dn, h, 0, dn.n / kBlockN, s.y.data(), s.ldy);
  }
  if (s.dy.empty()) return;
  const ActView dy = put_rows(bm, 2, s.dy.data(), s.ldy, m, round_up(dn.n, 64), 0);
  times_w_bf16(kern, bm, dn, dy, s.da.data(), s.ldh);  // [m, S]
  silu_backward(s, m, sl, row_w, dw);
  const ActView dc = put_rows(bm, 3, s.c.data(), s.ldc, m, round_up(gu.n, 64), 0);
  times_w_bf16(kern, bm, gu, dc, s.dx.data(), s.ldx);  // [m, Hp]
}

void expert_task(GradPlan& p, int g, int a, std::vector<long>& row_slot) {
  PackedMatrix gu, dn;
  expert_matrices(*p.layer, g, p.routing.experts[a], gu, dn);
  const int m = p.routing.rows[a], sl = dn.k, H = p.hidden;
  const long first = p.routing.first_row[a];
  const bool grad = p.call->dy != nullptr, want_y = p.call->out != nullptr;
  const GradKernels& kern = *p.kern;
  thread_local Scratch s;
  const bool bf16 = p.bf16_math;
  s.size(bf16 ? int(round_up(m, 16)) : m, gu.k, dn.n, sl, grad, want_y);
  gather(p, a, gu.k, dn.n, s);
  std::vector<float> dw(m, 0.0f);
  if (bf16) {
    const MoEConfig& cfg = p.layer->config();
    const bool amx = cfg.max_isa == Isa::kAmx && m >= cfg.amx_min_tokens;
    const Bf16Math bm{&kernels_of(amx ? Isa::kAmx : Isa::kAvx512),
                      &kernels_of(Isa::kAvx512).epilogue, amx,
                      u8_activations(gu.format) ? cfg.group_size : 0};
    bf16_expert(p, bm, gu, dn, m, p.routing.row_weight.data() + first, dw.data(), s);
  } else {
    times_wt(kern, gu, s.x.data(), s.ldx, m, s.c.data(), s.ldc, s.panel.data());  // [m, 2S]
    for (int i = 0; i < m; ++i)
      kern.silu(s.c.data() + i * s.ldc, sl, s.h.data() + i * s.ldh, s.sig.data() + i * s.ldh);
    if (want_y) times_wt(kern, dn, s.h.data(), s.ldh, m, s.y.data(), s.ldy, s.panel.data());
    if (grad) {
      times_w(kern, dn, s.dy.data(), s.ldy, m, s.da.data(), s.ldh, s.panel.data());  // [m, S]
      silu_backward(s, m, sl, p.routing.row_weight.data() + first, dw.data());
      times_w(kern, gu, s.c.data(), s.ldc, m, s.dx.data(), s.ldx, s.panel.data());  // [m, Hp]
    }
  }
  const size_t slots = size_t(p.call->q) * p.call->k;
  for (int i = 0; i < m; ++i) {
    const size_t at = size_t(g) * slots + row_slot[first + i];
    if (grad) {
      std::memcpy(p.dx_slots + at * H, s.dx.data() + size_t(i) * s.ldx, sizeof(float) * H);
      p.dw_slots[at] = dw[i];
    }
    if (want_y)
      std::memcpy(p.y_slots + at * H, s.y.data() + size_t(i) * s.ldy, sizeof(float) * H);
  }
}

// dx[t] = sum over groups and routed slots; dweights[t, j] = sum over groups; out[t] = sum
// over slots of w_j * (sum over groups of y).
void combine_token(const GradPlan& p, int t) {
  const MoEGradCall& c = *p.call;
  const size_t slots = size_t(c.q) * c.k, H = size_t(p.hidden);
  float* dx = c.dy ? c.dx + size_t(t) * H : nullptr;
  float* out = c.out ? c.out + size_t(t) * H : nullptr;
  if (dx) std::fill(dx, dx + H, 0.0f);
  if (out) std::fill(out, out + H, 0.0f);
  for (int j = 0; j < c.k; ++j) {
    const size_t slot = size_t(t) * c.k + j;
    float dw = 0.0f;
    if (p.routing.slot_row[slot] >= 0)
      for (int g = 0; g < p.groups; ++g) {
        if (p.layer->slice_begin(g + 1) == p.layer->slice_begin(g)) continue;
        const size_t at = size_t(g) * slots + slot;
        if (dx)
          for (size_t h = 0; h < H; ++h) dx[h] += p.dx_slots[at * H + h];
        if (out)
          for (size_t h = 0; h < H; ++h) out[h] += c.weights[slot] * p.y_slots[at * H + h];
        if (dx) dw += p.dw_slots[at];
      }
    if (dx) c.dweights[slot] = dw;
  }
}

}  // namespace

void moe_backward(const MoELayer& layer, ThreadPool& pool, const MoEGradCall& call) {
  const MoEConfig& cfg = layer.config();
  const int E = cfg.num_experts;
  std::vector<uint8_t> mask, loaded(call.loaded, call.loaded + E);
  if (call.gpu_mask) mask.assign(call.gpu_mask, call.gpu_mask + E);
  GradPlan p{&layer, &call, &grad_kernels(cfg.max_isa),
             route(call.ids, call.weights, call.q, call.k, E, mask, loaded)};
  p.groups = layer.num_groups();
  p.hidden = cfg.hidden;
  p.bf16_math = call.bf16_math && p.kern->pack_transposed != nullptr;
  const size_t slots = size_t(call.q) * call.k;
  if (call.dy) p.dx_slots = slot_arena(0, size_t(p.groups) * slots * cfg.hidden);
  if (call.dy) p.dw_slots = slot_arena(1, size_t(p.groups) * slots);
  if (call.out) p.y_slots = slot_arena(2, size_t(p.groups) * slots * cfg.hidden);
  std::vector<long> row_slot(p.routing.total_rows, -1);
  for (size_t i = 0; i < slots; ++i)
    if (p.routing.slot_row[i] >= 0) row_slot[p.routing.slot_row[i]] = long(i);
  // Tasks: (layer group, expert) pairs; a pool with the layer's groups runs group g's on its
  // own workers (the slice is in its node's memory), another pool runs them in turn.
  std::vector<std::pair<int, int>> pairs;
  for (int g = 0; g < p.groups; ++g)
    if (layer.slice_begin(g + 1) > layer.slice_begin(g))
      for (int a = 0; a < int(p.routing.experts.size()); ++a) pairs.emplace_back(g, a);
  const int pg = pool.num_groups();
  const bool matched = pg == p.groups;
  const size_t n_active = p.routing.experts.size();
  Phase experts{matched ? n_active : (pairs.size() + pg - 1) / pg,
                [&](size_t task, int group, int) {
    if (matched) {
      if (layer.slice_begin(group + 1) > layer.slice_begin(group))
        expert_task(p, group, int(task), row_slot);
      return;
    }
    const size_t i = task * pg + group;
    if (i < pairs.size()) expert_task(p, pairs[i].first, pairs[i].second, row_slot);
  }};
  Phase combine{(size_t(call.q) + pg - 1) / pg, [&](size_t task, int group, int) {
    const size_t t = task * pg + group;
    if (t < size_t(call.q)) combine_token(p, int(t));
  }};
  pool.run(Job{experts, combine});
}

}  // namespace hetmoe
