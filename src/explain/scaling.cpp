// The scaling argument of Vaswani et al. 2017 (sec. 3.2.1, footnote 4), measured: for q, k with
// independent N(0,1) entries, q.k has mean 0 and variance d_k; unscaled, the scores of n keys
// spread with standard deviation sqrt(d_k), the softmax saturates towards one-hot and its
// Jacobian diag(a) - a a^T (the gradient the scores receive) vanishes; scaled by 1/sqrt(d_k)
// the variance is 1 whatever d_k.
//
// Random numbers: detail::Rng (tensor/random.hpp), so the figures are reproducible from the seed
// on any standard library.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <string>

#include "explain/draw.hpp"
#include "qkv/error.hpp"
#include "qkv/explain.hpp"
#include "tensor/random.hpp"

namespace qkv::explain {
namespace {

using detail::Rgb;

// Welford's running mean and variance (population variance of all values seen).
struct Moments {
  double n = 0, mean = 0, m2 = 0;
  void add(double x) {
    n += 1;
    const double d = x - mean;
    mean += d / n;
    m2 += d * (x - mean);
  }
  double var() const { return n > 1 ? m2 / (n - 1) : 0.0; }
};

struct SoftmaxStats {
  double max_weight = 0, entropy = 0, jacobian = 0;
};

SoftmaxStats softmax_stats(const std::vector<double>& s, std::vector<double>& a) {
  const double mx = *std::max_element(s.begin(), s.end());
  double sum = 0;
  for (std::size_t j = 0; j < s.size(); ++j) sum += a[j] = std::exp(s[j] - mx);
  SoftmaxStats st;
  for (std::size_t j = 0; j < s.size(); ++j) {
    a[j] /= sum;
    st.max_weight = std::max(st.max_weight, a[j]);
    if (a[j] > 0) st.entropy -= a[j] * std::log(a[j]);
  }
  st.jacobian = softmax_jacobian_frobenius(a.data(), static_cast<std::int64_t>(a.size()));
  return st;
}

double median(std::vector<double> x) {
  const std::size_t m = x.size() / 2;
  std::nth_element(x.begin(), x.begin() + static_cast<std::ptrdiff_t>(m), x.end());
  if (x.size() % 2) return x[m];
  const double hi = x[m];
  return 0.5 * (hi + *std::max_element(x.begin(), x.begin() + static_cast<std::ptrdiff_t>(m)));
}

std::string fmt(const char* f, double x) {
  char buf[64];
  std::snprintf(buf, sizeof buf, f, x);
  return buf;
}

}  // namespace

double softmax_jacobian_frobenius(const double* a, std::int64_t n) noexcept {
  // ||J||_F^2 = sum_i (a_i - a_i^2)^2 + sum_{i != j} a_i^2 a_j^2 = sum a^2 - 2 sum a^3 + (sum a^2)^2.
  double s2 = 0, s3 = 0;
  for (std::int64_t i = 0; i < n; ++i) {
    s2 += a[i] * a[i];
    s3 += a[i] * a[i] * a[i];
  }
  return std::sqrt(std::max(0.0, s2 - 2 * s3 + s2 * s2));
}

std::vector<ScalingRow> scaling_study(const ScalingOptions& o) {
  if (o.n_keys < 2) throw Error("n_keys: expected >= 2, got " + std::to_string(o.n_keys));
  if (o.samples < 2) throw Error("samples: expected >= 2, got " + std::to_string(o.samples));
  if (o.d_k.empty()) throw Error("d_k: expected at least one head dimension");
  for (const auto d : o.d_k)
    if (d < 1 || d > (1 << 20)) throw Error("d_k: expected values in [1, 2^20], got " + std::to_string(d));
  if (o.samples * o.n_keys > (std::int64_t{1} << 32))
    throw Error("samples: expected samples * n_keys <= 2^32, got " + std::to_string(o.samples) + " * " +
                std::to_string(o.n_keys));
  std::vector<ScalingRow> rows;
  for (const std::int64_t d : o.d_k) {
    // Each d_k draws from its own stream so that adding a d_k leaves the others unchanged.
    qkv::detail::Rng rng(o.seed * 0x9E3779B97F4A7C15ull + static_cast<std::uint64_t>(d));
    const double inv = 1.0 / std::sqrt(static_cast<double>(d));
    std::vector<double> q(static_cast<std::size_t>(d)), s(static_cast<std::size_t>(o.n_keys)),
        ss(static_cast<std::size_t>(o.n_keys)), a(static_cast<std::size_t>(o.n_keys));
    Moments dot, scaled, sq_means;
    std::vector<double> jac_u, jac_s;
    jac_u.reserve(static_cast<std::size_t>(o.samples));
    jac_s.reserve(static_cast<std::size_t>(o.samples));
    ScalingRow r;
    r.d_k = d;
    for (std::int64_t n = 0; n < o.samples; ++n) {
      for (auto& x : q) x = rng.normal();
      double sq = 0;
      for (std::int64_t j = 0; j < o.n_keys; ++j) {
        double acc = 0;
        for (std::int64_t x = 0; x < d; ++x) acc += q[static_cast<std::size_t>(x)] * rng.normal();
        s[static_cast<std::size_t>(j)] = acc;
        ss[static_cast<std::size_t>(j)] = acc * inv;
        dot.add(acc);
        scaled.add(acc * inv);
        sq += acc * acc;
      }
      sq_means.add(sq / static_cast<double>(o.n_keys));
      const SoftmaxStats u = softmax_stats(s, a), c = softmax_stats(ss, a);
      r.max_weight += u.max_weight;
      r.entropy += u.entropy;
      r.jacobian += u.jacobian;
      r.max_weight_scaled += c.max_weight;
      r.entropy_scaled += c.entropy;
      r.jacobian_scaled += c.jacobian;
      jac_u.push_back(u.jacobian);
      jac_s.push_back(c.jacobian);
      r.vanished += u.jacobian < o.vanish_threshold;
      r.vanished_scaled += c.jacobian < o.vanish_threshold;
      r.one_hot += u.max_weight > 0.99;
      r.one_hot_scaled += c.max_weight > 0.99;
    }
    r.jacobian_median = median(jac_u);
    r.jacobian_median_scaled = median(jac_s);
    r.vanished /= static_cast<double>(o.samples);
    r.vanished_scaled /= static_cast<double>(o.samples);
    r.one_hot /= static_cast<double>(o.samples);
    r.one_hot_scaled /= static_cast<double>(o.samples);
    const double ns = static_cast<double>(o.samples);
    r.max_weight /= ns;
    r.entropy /= ns;
    r.jacobian /= ns;
    r.max_weight_scaled /= ns;
    r.entropy_scaled /= ns;
    r.jacobian_scaled /= ns;
    r.mean_dot = dot.mean;
    r.var_dot = dot.var();
    r.mean_scaled = scaled.mean;
    r.var_scaled = scaled.var();
    r.var_dot_stderr = std::sqrt(sq_means.var() / ns);
    rows.push_back(r);
  }
  return rows;
}

std::string format_scaling(const std::vector<ScalingRow>& rows, const ScalingOptions& o) {
  const double n = static_cast<double>(o.n_keys), ln_n = std::log(n);
  const double j_uniform = std::sqrt(1.0 / n - 1.0 / (n * n));
  std::string t;
  char buf[512];
  std::snprintf(
      buf, sizeof buf,
      "The scaling argument, measured: q, k with independent N(0,1) entries, %lld samples x %lld keys per "
      "d_k "
      "(seed %llu).\nscore s = q.k (unscaled) or q.k/sqrt(d_k) (scaled); softmax over n = %lld keys.\n\n",
      static_cast<long long>(o.samples), static_cast<long long>(o.n_keys),
      static_cast<unsigned long long>(o.seed), static_cast<long long>(o.n_keys));
  t += buf;
  std::snprintf(buf, sizeof buf, "%6s | %9s %10s %10s %8s | %9s %8s | %8s %8s\n", "d_k", "mean q.k",
                "var q.k", "(expect)", "std q.k", "mean scl", "var scl", "std scl", "(expect)");
  t += buf;
  for (const auto& r : rows) {
    std::snprintf(buf, sizeof buf, "%6lld | %9.4f %10.4g %10lld %8.4f | %9.5f %8.5f | %8.5f %8d\n",
                  static_cast<long long>(r.d_k), r.mean_dot, r.var_dot, static_cast<long long>(r.d_k),
                  std::sqrt(r.var_dot), r.mean_scaled, r.var_scaled, std::sqrt(r.var_scaled), 1);
    t += buf;
  }
  std::snprintf(buf, sizeof buf,
                "\nsoftmax over %lld keys: largest weight (mean over samples; uniform %.4f, one-hot 1), "
                "fraction of samples\n"
                "effectively one-hot (largest weight > 0.99), entropy in nats (mean; uniform ln %lld = %.4f, "
                "one-hot 0)\n",
                static_cast<long long>(o.n_keys), 1.0 / n, static_cast<long long>(o.n_keys), ln_n);
  t += buf;
  std::snprintf(buf, sizeof buf, "%6s | %10s %10s | %10s %10s | %10s %10s\n", "d_k", "max w", "max w scl",
                "one-hot", "1-hot scl", "entropy", "entr. scl");
  t += buf;
  for (const auto& r : rows) {
    std::snprintf(buf, sizeof buf, "%6lld | %10.4f %10.4f | %9.1f%% %9.1f%% | %10.4f %10.4f\n",
                  static_cast<long long>(r.d_k), r.max_weight, r.max_weight_scaled, 100 * r.one_hot,
                  100 * r.one_hot_scaled, r.entropy, r.entropy_scaled);
    t += buf;
  }
  std::snprintf(
      buf, sizeof buf,
      "\ngradient reaching the logits: Frobenius norm ||J||_F of the softmax Jacobian diag(a) - a a^T "
      "(uniform %.4f,\n"
      "one-hot 0): mean and median over samples, and the fraction of samples with ||J||_F < %g (vanished)\n",
      j_uniform, o.vanish_threshold);
  t += buf;
  std::snprintf(buf, sizeof buf, "%6s | %10s %10s | %10s %10s | %10s %10s\n", "d_k", "mean", "mean scl",
                "median", "median scl", "vanished", "vanish scl");
  t += buf;
  for (const auto& r : rows) {
    std::snprintf(buf, sizeof buf, "%6lld | %10.4g %10.4g | %10.4g %10.4g | %9.1f%% %9.1f%%\n",
                  static_cast<long long>(r.d_k), r.jacobian, r.jacobian_scaled, r.jacobian_median,
                  r.jacobian_median_scaled, 100 * r.vanished, 100 * r.vanished_scaled);
    t += buf;
  }
  // The reading, from the measured row for d_k = 64 (or the largest d_k measured).
  const ScalingRow* r = &rows.back();
  for (const auto& x : rows)
    if (x.d_k == 64) r = &x;
  std::snprintf(buf, sizeof buf,
                "\nAt d_k = %lld: unscaled scores have standard deviation %.3f (sqrt(d_k) = %.3f). The "
                "softmax leans towards\n"
                "one key: largest weight %.3f on average (%.3f scaled), %.1f%% of rows effectively one-hot "
                "(%.1f%% scaled),\n"
                "entropy %.3f of %.3f nats (%.3f scaled); in %.1f%% of rows ||J||_F < %g, the scores get "
                "almost no gradient\n"
                "(%.1f%% scaled); median ||J||_F %.4g (%.4g scaled). Scaled by 1/sqrt(d_k), the variance is "
                "%.4f (expected 1).\n",
                static_cast<long long>(r->d_k), std::sqrt(r->var_dot), std::sqrt(static_cast<double>(r->d_k)),
                r->max_weight, r->max_weight_scaled, 100 * r->one_hot, 100 * r->one_hot_scaled, r->entropy,
                ln_n, r->entropy_scaled, 100 * r->vanished, o.vanish_threshold, 100 * r->vanished_scaled,
                r->jacobian_median, r->jacobian_median_scaled, r->var_scaled);
  t += buf;
  t += "Rows with vanished gradient (||J||_F < " + fmt("%g", o.vanish_threshold) + "), unscaled:";
  for (const auto& x : rows) {
    t += " d_k ";
    t += std::to_string(x.d_k);
    t += ' ';
    t += fmt("%.1f%%", 100 * x.vanished);
    if (&x != &rows.back()) t += ',';
  }
  t += ";\nscaled:";
  for (const auto& x : rows) {
    t += ' ';
    t += fmt("%.1f%%", 100 * x.vanished_scaled);
    if (&x != &rows.back()) t += ',';
  }
  t += ".\n";
  return t;
}

// ---- the plot ----------------------------------------------------------------------------------

namespace {

struct Series {
  std::string name;
  Rgb colour;
  std::vector<double> y;
  bool dashed = false;
};
struct Panel {
  std::string title;
  std::vector<Series> series;
  double ymin = 0, ymax = 1;
};

constexpr Rgb kUnscaled{0xd9, 0x5f, 0x02}, kScaled{0x1b, 0x9e, 0x77}, kExpected{0x70, 0x70, 0x70};
constexpr int kPanelW = 340, kPanelH = 240, kPlotL = 52, kPlotR = 14, kPlotT = 24, kPlotB = 34, kMargin = 12;
constexpr int kTitleH = 28, kLegendH = 26;

std::vector<Panel> make_panels(const std::vector<ScalingRow>& rows, const ScalingOptions& o) {
  Series su{"unscaled q.k", kUnscaled, {}}, sc{"scaled q.k/sqrt(d_k)", kScaled, {}};
  Panel p1{"standard deviation of the scores", {}, 0, 0}, p2{"mean largest softmax weight", {}, 0, 1},
      p3{"mean entropy of the weights (nats)", {}, 0, 0}, p4{"median ||diag(a) - a a^T||_F", {}, 0, 0};
  Series e1{"expected sqrt(d_k), 1", kExpected, {}, true}, e3{"uniform: ln n", kExpected, {}, true};
  Series u1 = su, c1 = sc, u2 = su, c2 = sc, u3 = su, c3 = sc, u4 = su, c4 = sc;
  Series e4{"uniform: sqrt(1/n - 1/n^2)", kExpected, {}, true};
  const double n = static_cast<double>(o.n_keys);
  for (const auto& r : rows) {
    u1.y.push_back(std::sqrt(r.var_dot));
    c1.y.push_back(std::sqrt(r.var_scaled));
    e1.y.push_back(std::sqrt(static_cast<double>(r.d_k)));
    u2.y.push_back(r.max_weight);
    c2.y.push_back(r.max_weight_scaled);
    u3.y.push_back(r.entropy);
    c3.y.push_back(r.entropy_scaled);
    e3.y.push_back(std::log(n));
    u4.y.push_back(r.jacobian_median);
    c4.y.push_back(r.jacobian_median_scaled);
    e4.y.push_back(std::sqrt(1 / n - 1 / (n * n)));
  }
  p1.series = {e1, u1, c1};
  p2.series = {u2, c2};
  p3.series = {e3, u3, c3};
  p4.series = {e4, u4, c4};
  std::vector<Panel> ps{p1, p2, p3, p4};
  for (auto& p : ps) {
    if (p.ymax > p.ymin) continue;
    double mx = 0;
    for (const auto& s : p.series)
      for (const double y : s.y)
        if (std::isfinite(y)) mx = std::max(mx, y);
    // Round up so that the four tick intervals are 1, 2, 2.5 or 5 times a power of ten.
    if (!(mx > 0)) {
      p.ymax = 1;
      continue;
    }
    const double unit = std::pow(10.0, std::floor(std::log10(mx / 4)));
    for (const double m : {1.0, 2.0, 2.5, 5.0, 10.0})
      if (4 * m * unit >= mx * 1.02) {
        p.ymax = 4 * m * unit;
        break;
      }
  }
  return ps;
}

struct PlotGeom {
  int width = 2 * kPanelW + 3 * kMargin, height = kTitleH + 2 * kPanelH + kLegendH + 2 * kMargin;
  int px(int p) const { return kMargin + (p % 2) * (kPanelW + kMargin); }
  int py(int p) const { return kTitleH + kMargin + (p / 2) * kPanelH; }
  double x_at(int p, std::size_t k, std::size_t n) const {
    const double w = kPanelW - kPlotL - kPlotR;
    return px(p) + kPlotL + (n <= 1 ? w / 2 : w * static_cast<double>(k) / static_cast<double>(n - 1));
  }
  double y_at(int p, const Panel& pl, double y) const {
    const double h = kPanelH - kPlotT - kPlotB;
    const double t = std::clamp((y - pl.ymin) / (pl.ymax - pl.ymin), -0.05, 1.05);
    return py(p) + kPlotT + h * (1 - t);
  }
};

const char* kPlotTitle = "The scaling argument: softmax over n keys of q.k, with and without 1/sqrt(d_k)";

Image render_plot(const std::vector<Panel>& ps, const std::vector<ScalingRow>& rows) {
  PlotGeom g;
  detail::Canvas c(g.width, g.height);
  c.text(kMargin, kMargin, kPlotTitle, detail::kBlack);
  const std::size_t n = rows.size();
  for (int p = 0; p < 4; ++p) {
    const Panel& pl = ps[static_cast<std::size_t>(p)];
    const int x0 = g.px(p) + kPlotL, x1 = g.px(p) + kPanelW - kPlotR, y0 = g.py(p) + kPlotT,
              y1 = g.py(p) + kPanelH - kPlotB;
    c.text(g.px(p) + kPlotL, g.py(p) + 6, pl.title, detail::kBlack);
    c.line(x0, y1, x1, y1, detail::kBlack);
    c.line(x0, y0, x0, y1, detail::kBlack);
    for (int t = 0; t <= 4; ++t) {
      const double v = pl.ymin + (pl.ymax - pl.ymin) * t / 4;
      const int y = static_cast<int>(std::lround(g.y_at(p, pl, v)));
      c.line(x0 + 1, y, x1, y, detail::kLight);
      c.line(x0 - 4, y, x0, y, detail::kBlack);
      const std::string lab = detail::tick_label(v);
      c.text(x0 - 6 - detail::text_width(lab), y - 3, lab, detail::kBlack);
    }
    for (std::size_t k = 0; k < n; ++k) {
      const int x = static_cast<int>(std::lround(g.x_at(p, k, n)));
      c.line(x, y1, x, y1 + 4, detail::kBlack);
      const std::string lab = std::to_string(rows[k].d_k);
      c.text(x - detail::text_width(lab) / 2, y1 + 7, lab, detail::kBlack);
    }
    c.text((x0 + x1) / 2 - detail::text_width("d_k") / 2, y1 + 19, "d_k", detail::kGrey);
    for (const auto& s : pl.series) {
      for (std::size_t k = 0; k + 1 < n; ++k) {
        const double xa = g.x_at(p, k, n), ya = g.y_at(p, pl, s.y[k]), xb = g.x_at(p, k + 1, n),
                     yb = g.y_at(p, pl, s.y[k + 1]);
        if (!s.dashed) {
          c.line(xa, ya, xb, yb, s.colour, 2);
          continue;
        }
        const double len = std::hypot(xb - xa, yb - ya);
        for (double d = 0; d < len; d += 10) {
          const double e = std::min(len, d + 6);
          c.line(xa + (xb - xa) * d / len, ya + (yb - ya) * d / len, xa + (xb - xa) * e / len,
                 ya + (yb - ya) * e / len, s.colour, 1);
        }
      }
      if (!s.dashed)
        for (std::size_t k = 0; k < n; ++k) {
          const int x = static_cast<int>(std::lround(g.x_at(p, k, n))),
                    y = static_cast<int>(std::lround(g.y_at(p, pl, s.y[k])));
          c.fill(x - 3, y - 3, x + 4, y + 4, s.colour);
        }
    }
  }
  // Legend.
  int lx = kMargin;
  const int ly = g.height - kMargin - 10;
  for (const auto& [name, col, dashed] :
       {std::tuple{"unscaled q.k", kUnscaled, false}, std::tuple{"scaled q.k/sqrt(d_k)", kScaled, false},
        std::tuple{"expected / uniform reference", kExpected, true}}) {
    if (dashed) {
      c.line(lx, ly + 4, lx + 8, ly + 4, col);
      c.line(lx + 14, ly + 4, lx + 22, ly + 4, col);
    } else
      c.line(lx, ly + 4, lx + 22, ly + 4, col, 2);
    lx += 28 + c.text(lx + 28, ly, name, detail::kBlack) + 24;
  }
  return std::move(c).take();
}

std::string plot_svg(const std::vector<Panel>& ps, const std::vector<ScalingRow>& rows) {
  PlotGeom g;
  using std::to_string;
  auto num = [](double x) { return fmt("%.2f", x); };
  std::string o = "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" + to_string(g.width) + "\" height=\"" +
                  to_string(g.height) + "\" viewBox=\"0 0 " + to_string(g.width) + " " + to_string(g.height) +
                  "\" font-family=\"sans-serif\" font-size=\"11\">\n<rect width=\"100%\" height=\"100%\" "
                  "fill=\"#ffffff\"/>\n";
  o += "<text x=\"" + to_string(kMargin) + "\" y=\"" + to_string(kMargin + 10) + "\" font-size=\"13\">" +
       detail::xml_escape(kPlotTitle) + "</text>\n";
  const std::size_t n = rows.size();
  for (int p = 0; p < 4; ++p) {
    const Panel& pl = ps[static_cast<std::size_t>(p)];
    const int x0 = g.px(p) + kPlotL, x1 = g.px(p) + kPanelW - kPlotR, y0 = g.py(p) + kPlotT,
              y1 = g.py(p) + kPanelH - kPlotB;
    o += "<g class=\"panel\">\n<text x=\"" + to_string(x0) + "\" y=\"" + to_string(g.py(p) + 14) + "\">" +
         detail::xml_escape(pl.title) + "</text>\n";
    for (int t = 0; t <= 4; ++t) {
      const double v = pl.ymin + (pl.ymax - pl.ymin) * t / 4;
      const std::string y = num(g.y_at(p, pl, v));
      o += "<line x1=\"" + to_string(x0) + "\" y1=\"" + y + "\" x2=\"" + to_string(x1) + "\" y2=\"" + y +
           "\" stroke=\"#dcdcdc\"/><text x=\"" + to_string(x0 - 6) + "\" y=\"" + y +
           "\" dy=\"4\" text-anchor=\"end\">" + detail::tick_label(v) + "</text>\n";
    }
    o += "<path d=\"M" + to_string(x0) + " " + to_string(y0) + "V" + to_string(y1) + "H" + to_string(x1) +
         "\" fill=\"none\" stroke=\"#000\"/>\n";
    for (std::size_t k = 0; k < n; ++k)
      o += "<text x=\"" + num(g.x_at(p, k, n)) + "\" y=\"" + to_string(y1 + 15) +
           "\" text-anchor=\"middle\">" + to_string(rows[k].d_k) + "</text>\n";
    o += "<text x=\"" + to_string((x0 + x1) / 2) + "\" y=\"" + to_string(y1 + 28) +
         "\" text-anchor=\"middle\" fill=\"#808080\">d_k</text>\n";
    for (const auto& s : pl.series) {
      o += "<polyline class=\"series\" fill=\"none\" stroke=\"" + detail::hex(s.colour) +
           "\" stroke-width=\"" + (s.dashed ? "1\" stroke-dasharray=\"6 4" : "2") + "\" points=\"";
      for (std::size_t k = 0; k < n; ++k) o += num(g.x_at(p, k, n)) + "," + num(g.y_at(p, pl, s.y[k])) + " ";
      o += "\"><title>" + detail::xml_escape(s.name) + "</title></polyline>\n";
      if (!s.dashed)
        for (std::size_t k = 0; k < n; ++k)
          o += "<circle cx=\"" + num(g.x_at(p, k, n)) + "\" cy=\"" + num(g.y_at(p, pl, s.y[k])) +
               "\" r=\"3\" fill=\"" + detail::hex(s.colour) + "\"><title>d_k " + to_string(rows[k].d_k) +
               ": " + fmt("%.6g", s.y[k]) + "</title></circle>\n";
    }
    o += "</g>\n";
  }
  int lx = kMargin;
  const int ly = g.height - kMargin - 6;
  for (const auto& [name, col, dashed] :
       {std::tuple{"unscaled q.k", kUnscaled, false}, std::tuple{"scaled q.k/sqrt(d_k)", kScaled, false},
        std::tuple{"expected / uniform reference", kExpected, true}}) {
    o += "<line x1=\"" + to_string(lx) + "\" y1=\"" + to_string(ly) + "\" x2=\"" + to_string(lx + 22) +
         "\" y2=\"" + to_string(ly) + "\" stroke=\"" + detail::hex(col) + "\" stroke-width=\"" +
         (dashed ? "1\" stroke-dasharray=\"6 4" : "2") + "\"/><text x=\"" + to_string(lx + 28) + "\" y=\"" +
         to_string(ly + 4) + "\">" + name + "</text>\n";
    lx += 28 + 7 * static_cast<int>(std::string(name).size()) + 24;
  }
  o += "</svg>\n";
  return o;
}

}  // namespace

void write_scaling_plot(const std::filesystem::path& path, const std::vector<ScalingRow>& rows,
                        const ScalingOptions& o) {
  if (rows.empty()) throw Error("plot: expected at least one measured d_k");
  const auto ps = make_panels(rows, o);
  detail::write_figure(path, "plot", "the scaling argument, measured", [&] { return render_plot(ps, rows); },
                       [&] { return plot_svg(ps, rows); });
}

}  // namespace qkv::explain
