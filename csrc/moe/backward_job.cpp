// The routed experts' backward (backward_job.h): one task per (NUMA group, expert) recomputes
// the expert's activations for its rows and writes per-slot partial dx and dweights; a second
// phase sums each token's slots and groups.
#include "moe/backward_job.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "kernels/grad.h"
#include "layout/bf16.h"
#include "moe/routing.h"

namespace hetmoe {
namespace {

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

// Per-task buffers, reused by each worker's later tasks.
struct Scratch {
  std::vector<float> x, dy, c, h, dh, dx, w, y;
  void size(int m, int hp, int hn, int s, bool want_y) {
    y.assign(want_y ? size_t(m) * hn : 0, 0.0f);
    x.assign(size_t(m) * hp, 0.0f);
    dy.assign(size_t(m) * hn, 0.0f);
    c.resize(size_t(m) * 2 * s);
    h.resize(size_t(m) * s);
    dh.assign(size_t(m) * s, 0.0f);
    dx.assign(size_t(m) * hp, 0.0f);
    w.resize(size_t(kBlockN) * std::max(hp, s));
  }
};

// c[i][16 nb + n] = dot(x_i, W[16 nb + n]) over every n-block of w (x rows ld = w.k).
void rows_times_wt(const GradKernels& kern, const PackedMatrix& w, const float* x, int m,
                   float* c, float* wbuf) {
  for (int nb = 0; nb < w.n / kBlockN; ++nb) {
    kern.unpack(w, nb, wbuf, size_t(w.k));
    for (int i = 0; i < m; ++i)
      for (int n = 0; n < kBlockN; ++n)
        c[size_t(i) * w.n + nb * kBlockN + n] =
            kern.dot(x + size_t(i) * w.k, wbuf + size_t(n) * w.k, w.k);
  }
}

// Down: y_i = h_i W^T (kept in s.y when asked; with dY its dot with dY_i: dweights) and
// dh_i = (w_i dY_i) W.
void down_pass(const GradKernels& kern, const PackedMatrix& dn, Scratch& s, int m,
               const float* row_w, bool grad, float* dws) {
  const int hn = dn.n, sl = dn.k;
  const bool want_y = !s.y.empty();
  for (int nb = 0; nb < hn / kBlockN; ++nb) {
    kern.unpack(dn, nb, s.w.data(), size_t(sl));
    for (int i = 0; i < m; ++i) {
      const float* h = s.h.data() + size_t(i) * sl;
      float* dh = s.dh.data() + size_t(i) * sl;
      float acc = 0.0f;
      for (int n = 0; n < kBlockN; ++n) {
        const float d = grad ? s.dy[size_t(i) * hn + nb * kBlockN + n] : 0.0f;
        if (d == 0.0f && !want_y) continue;  // padded rows past H, or a zero gradient
        const float* wn = s.w.data() + size_t(n) * sl;
        const float y = kern.dot(h, wn, sl);
        if (want_y) s.y[size_t(i) * hn + nb * kBlockN + n] = y;
        if (d == 0.0f) continue;
        acc += d * y;
        kern.axpy(row_w[i] * d, wn, sl, dh);
      }
      dws[i] += acc;
    }
  }
}

// c holds [gate block b, up block b] pairs of 16 columns; h = silu(g) * u. After dh is known,
// c becomes the gradient of those columns: dg = dh * u * silu'(g), du = dh * silu(g).
void silu_forward(Scratch& s, int m, int sl) {
  for (int i = 0; i < m; ++i)
    for (int j = 0; j < sl; ++j) {
      const float* c = s.c.data() + size_t(i) * 2 * sl + (j / 16) * 32 + j % 16;
      const float g = c[0], u = c[16];
      s.h[size_t(i) * sl + j] = g / (1.0f + std::exp(-g)) * u;
    }
}

void silu_backward(Scratch& s, int m, int sl) {
  for (int i = 0; i < m; ++i)
    for (int j = 0; j < sl; ++j) {
      float* c = s.c.data() + size_t(i) * 2 * sl + (j / 16) * 32 + j % 16;
      const float g = c[0], u = c[16], dh = s.dh[size_t(i) * sl + j];
      const float sig = 1.0f / (1.0f + std::exp(-g));
      c[0] = dh * u * sig * (1.0f + g * (1.0f - sig));
      c[16] = dh * g * sig;
    }
}

// dx_i += sum_n a_i[n] W[n] over every n-block of w (a rows ld = w.n, dx rows ld = w.k).
void rows_times_w(const GradKernels& kern, const PackedMatrix& w, const float* a, int m,
                  float* dx, float* wbuf) {
  for (int nb = 0; nb < w.n / kBlockN; ++nb) {
    kern.unpack(w, nb, wbuf, size_t(w.k));
    for (int i = 0; i < m; ++i)
      for (int n = 0; n < kBlockN; ++n) {
        const float an = a[size_t(i) * w.n + nb * kBlockN + n];
        if (an != 0.0f) kern.axpy(an, wbuf + size_t(n) * w.k, w.k, dx + size_t(i) * w.k);
      }
  }
}

struct GradPlan {
  const MoELayer* layer;
  const MoEGradCall* call;
  const GradKernels* kern;
  Routing routing;
  int groups = 0, hidden = 0;
  std::vector<float> dx_slots;  // [G][q k][H]
  std::vector<float> dw_slots;  // [G][q k]
  std::vector<float> y_slots;   // [G][q k][H] with call.out: each slot's expert output
};

// Gathers expert a's rows (x, dY) into s: x zero-padded to gate/up's K, dY to down's N.
void gather(const GradPlan& p, int a, int hp, int hn, Scratch& s) {
  const MoEGradCall& c = *p.call;
  const int m = p.routing.rows[a], H = p.hidden;
  const long first = p.routing.first_row[a];
  for (int i = 0; i < m; ++i) {
    const int t = p.routing.row_token[first + i];
    float* xr = s.x.data() + size_t(i) * hp;
    if (c.x_type == DType::kFP32) {
      std::memcpy(xr, static_cast<const float*>(c.x) + size_t(t) * H, sizeof(float) * H);
    } else {
      const uint16_t* xb = static_cast<const uint16_t*>(c.x) + size_t(t) * H;
      for (int j = 0; j < H; ++j) xr[j] = bf16_to_float(xb[j]);
    }
    if (c.dy) std::memcpy(s.dy.data() + size_t(i) * hn, c.dy + size_t(t) * H, sizeof(float) * H);
  }
}

void expert_task(GradPlan& p, int g, int a, std::vector<long>& row_slot) {
  PackedMatrix gu, dn;
  expert_matrices(*p.layer, g, p.routing.experts[a], gu, dn);
  const int m = p.routing.rows[a], sl = dn.k, H = p.hidden;
  const long first = p.routing.first_row[a];
  const bool grad = p.call->dy != nullptr, want_y = p.call->out != nullptr;
  thread_local Scratch s;
  s.size(m, gu.k, dn.n, sl, want_y);
  gather(p, a, gu.k, dn.n, s);
  rows_times_wt(*p.kern, gu, s.x.data(), m, s.c.data(), s.w.data());
  silu_forward(s, m, sl);
  std::vector<float> dw(m, 0.0f);
  down_pass(*p.kern, dn, s, m, p.routing.row_weight.data() + first, grad, dw.data());
  if (grad) {
    silu_backward(s, m, sl);
    rows_times_w(*p.kern, gu, s.c.data(), m, s.dx.data(), s.w.data());
  }
  const size_t slots = size_t(p.call->q) * p.call->k;
  for (int i = 0; i < m; ++i) {
    const size_t at = size_t(g) * slots + row_slot[first + i];
    if (grad) {
      std::memcpy(p.dx_slots.data() + at * H, s.dx.data() + size_t(i) * gu.k, sizeof(float) * H);
      p.dw_slots[at] = dw[i];
    }
    if (want_y)
      std::memcpy(p.y_slots.data() + at * H, s.y.data() + size_t(i) * dn.n, sizeof(float) * H);
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
  const size_t slots = size_t(call.q) * call.k;
  if (call.dy) p.dx_slots.assign(size_t(p.groups) * slots * cfg.hidden, 0.0f);
  if (call.dy) p.dw_slots.assign(size_t(p.groups) * slots, 0.0f);
  if (call.out) p.y_slots.assign(size_t(p.groups) * slots * cfg.hidden, 0.0f);
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
