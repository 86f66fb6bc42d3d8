// The study's figures: one per quantity, a panel per d_k, the quantity against the step with a
// line per scale rule (the mean over seeds, smoothed by a trailing moving average) and each
// seed's own curve faint behind it. Both the PNG and the SVG are drawn from one display list
// (lines and texts in pixels), with explain's Canvas and figure writer.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <string>

#include "explain/draw.hpp"
#include "io/atomic_file.hpp"
#include "qkv/error.hpp"
#include "qkv/train.hpp"
#include "train/study_common.hpp"

namespace qkv::train {
namespace {

using explain::detail::Rgb;
using study_detail::Run;

struct Line {
  double x0, y0, x1, y1;
  Rgb c;
  int thick;
};
struct Text {
  double x, y;  // top-left (anchor start), top-centre (middle), top-right (end); rotated: see Canvas::text_up
  std::string s;
  Rgb c;
  int anchor = 0;  // 0 start, 1 middle, 2 end
  bool up = false;
};
struct Display {
  int w = 0, h = 0;
  std::vector<Line> lines;
  std::vector<Text> texts;
};

struct Quantity {
  const char* file;
  const char* title;
  double StepStats::*field;
  bool log;
  double fixed_max;  // > 0: the axis ends there; else rounded up from the data
};
constexpr Quantity kQuantities[] = {
    {"loss", "training loss (cross-entropy, nats)", &StepStats::loss, false, 0},
    {"accuracy", "task accuracy (scored positions)", &StepStats::accuracy, false, 1},
    {"max_weight", "mean largest attention weight", &StepStats::max_weight, false, 1},
    {"entropy", "mean attention entropy (nats)", &StepStats::entropy, false, 0},
    {"saturated_frac", "fraction of softmax rows with ||J||_F < 0.01", &StepStats::saturated, false, 1},
    {"grad_wq", "||dL/dW_Q|| (before clipping, log scale)", &StepStats::grad_wq, true, 0},
    {"grad_wk", "||dL/dW_K|| (before clipping, log scale)", &StepStats::grad_wk, true, 0},
};

// Colour-blind-safe (Okabe & Ito 2008): the standard scale, no scale, 1/d_k.
Rgb colour(ScaleRule r) {
  switch (r) {
    case ScaleRule::inv_sqrt_dk: return {0x00, 0x72, 0xb2};
    case ScaleRule::one: return {0xd5, 0x5e, 0x00};
    case ScaleRule::inv_dk: return {0x00, 0x9e, 0x73};
  }
  return {0, 0, 0};
}
Rgb faint(Rgb c) {
  Rgb o;
  for (int i = 0; i < 3; ++i) o[static_cast<std::size_t>(i)] = static_cast<std::uint8_t>(c[static_cast<std::size_t>(i)] / 3 + 170);
  return o;
}

double nice_max(double mx) {
  if (!(mx > 0)) return 1;
  const double unit = std::pow(10.0, std::floor(std::log10(mx / 4)));
  for (const double m : {1.0, 2.0, 2.5, 5.0, 10.0})
    if (4 * m * unit >= mx * 1.02) return 4 * m * unit;
  return mx;
}

constexpr int kPanelW = 330, kPanelH = 250, kL = 62, kR = 12, kT = 22, kB = 38, kMargin = 12, kTitleH = 26,
              kLegendH = 28;

Display layout(const Quantity& q, const std::vector<Run>& runs, const StudyOptions& o) {
  Display d;
  const int np = static_cast<int>(o.d_k.size());
  d.w = kMargin + np * (kPanelW + kMargin);
  d.h = kTitleH + kPanelH + kLegendH + 2 * kMargin;
  const Rgb black = explain::detail::kBlack, light = explain::detail::kLight, grey = explain::detail::kGrey;
  d.texts.push_back({double(kMargin), double(kMargin), std::string(q.title) + ", against the training step", black});
  const std::size_t window = std::max<std::size_t>(1, static_cast<std::size_t>(o.base.steps / 50));
  for (int p = 0; p < np; ++p) {
    const std::int64_t dk = o.d_k[static_cast<std::size_t>(p)];
    std::vector<const Run*> mine;
    for (const Run& r : runs)
      if (r.d_k == dk) mine.push_back(&r);
    // The y axis: over every value drawn in this figure (all panels share it, to compare d_k).
    double lo = INFINITY, hi = 0;
    for (const Run& r : runs)
      for (std::size_t i = 0; i < r.steps.size(); ++i) {
        const double v = study_detail::smoothed(r, i, q.field, window);
        if (!std::isfinite(v) || (q.log && !(v > 0))) continue;
        lo = std::min(lo, v);
        hi = std::max(hi, v);
      }
    double ymin = 0, ymax = q.fixed_max > 0 ? q.fixed_max : nice_max(hi);
    if (q.log) {
      ymin = std::isfinite(lo) ? std::floor(std::log10(lo)) : -1;
      ymax = hi > 0 ? std::ceil(std::log10(hi)) : 0;
      if (ymax <= ymin) ymax = ymin + 1;
    }
    const double px = kMargin + p * (kPanelW + kMargin), py = kTitleH + kMargin;
    const double x0 = px + kL, x1 = px + kPanelW - kR, y0 = py + kT, y1 = py + kPanelH - kB;
    const double steps = static_cast<double>(std::max<std::int64_t>(o.base.steps, 2));
    auto X = [&](double step) { return x0 + (x1 - x0) * (step - 1) / (steps - 1); };
    auto Y = [&](double v) {
      const double t = ((q.log ? std::log10(v) : v) - ymin) / (ymax - ymin);
      return y1 - (y1 - y0) * std::clamp(t, -0.02, 1.02);
    };
    d.texts.push_back({x0, py + 4, "d_k = " + std::to_string(dk), black});
    // Grid and ticks: four intervals, or one per decade on a log axis.
    const int nt = q.log ? static_cast<int>(ymax - ymin) : 4;
    for (int t = 0; t <= nt; ++t) {
      const double a = ymin + (ymax - ymin) * t / nt, v = q.log ? std::pow(10.0, a) : a;
      const double y = Y(v);
      d.lines.push_back({x0 + 1, y, x1, y, light, 1});
      d.lines.push_back({x0 - 4, y, x0, y, black, 1});
      d.texts.push_back({x0 - 6, y - 4, explain::detail::tick_label(v), black, 2});
    }
    for (int t = 0; t <= 4; ++t) {  // steps 1, then quarters of the run
      const long long s = t == 0 ? 1 : std::llround(steps * t / 4);
      const double x = X(static_cast<double>(s));
      d.lines.push_back({x, y1, x, y1 + 4, black, 1});
      d.texts.push_back({x, y1 + 7, std::to_string(s), black, 1});
    }
    d.lines.push_back({x0, y1, x1, y1, black, 1});
    d.lines.push_back({x0, y0, x0, y1, black, 1});
    d.texts.push_back({(x0 + x1) / 2, y1 + 20, "step", grey, 1});
    d.texts.push_back({px + 4, (y0 + y1) / 2 + 30, q.file, grey, 0, true});
    // Each seed faint, then the mean over seeds of each rule.
    for (const int pass : {0, 1})
      for (const ScaleRule rule : o.rules) {
        std::vector<const Run*> rs;
        for (const Run* r : mine)
          if (r->rule == rule) rs.push_back(r);
        if (rs.empty()) continue;
        const std::size_t n = rs.front()->steps.size();
        auto value = [&](std::size_t i) {
          double s = 0;
          for (const Run* r : rs) s += study_detail::smoothed(*r, i, q.field, window);
          return s / static_cast<double>(rs.size());
        };
        auto draw = [&](const std::function<double(std::size_t)>& f, Rgb c, int thick) {
          // At most ~120 segments per curve (the curves are smoothed anyway): the files stay small.
          const std::size_t stride = std::max<std::size_t>(1, n / 120);
          double px0 = NAN, py0 = NAN;
          for (std::size_t i = 0; i < n; i += stride) {
            const double v = f(i);
            if (!std::isfinite(v) || (q.log && !(v > 0))) {
              px0 = NAN;
              continue;
            }
            const double xx = X(static_cast<double>(i + 1)), yy = Y(v);
            if (std::isfinite(px0)) d.lines.push_back({px0, py0, xx, yy, c, thick});
            px0 = xx;
            py0 = yy;
          }
        };
        if (pass == 0 && rs.size() > 1)
          for (const Run* r : rs)
            draw([&](std::size_t i) { return study_detail::smoothed(*r, i, q.field, window); }, faint(colour(rule)), 1);
        if (pass == 1) draw(value, colour(rule), 2);
      }
  }
  // Legend.
  double lx = kMargin;
  const double ly = d.h - kMargin - 12;
  for (const ScaleRule rule : o.rules) {
    d.lines.push_back({lx, ly + 4, lx + 22, ly + 4, colour(rule), 2});
    const std::string name = std::string("scale = ") + scale_rule_name(rule);
    d.texts.push_back({lx + 28, ly, name, black});
    lx += 28 + explain::detail::text_width(name) + 24;
  }
  const std::string note = o.seeds.size() > 1 ? "thick: mean of " + std::to_string(o.seeds.size()) +
                                                    " seeds; faint: each seed; moving average of " +
                                                    std::to_string(window) + " steps"
                                              : "moving average of " + std::to_string(window) + " steps";
  d.texts.push_back({lx, ly, note, grey});
  return d;
}

explain::Image raster(const Display& d) {
  explain::detail::Canvas c(d.w, d.h);
  for (const Line& l : d.lines) c.line(l.x0, l.y0, l.x1, l.y1, l.c, l.thick);
  for (const Text& t : d.texts) {
    const int w = explain::detail::text_width(t.s);
    if (t.up) {
      c.text_up(static_cast<int>(t.x), static_cast<int>(t.y), t.s, t.c);
      continue;
    }
    const double x = t.anchor == 0 ? t.x : t.anchor == 1 ? t.x - w / 2.0 : t.x - w;
    c.text(static_cast<int>(std::lround(x)), static_cast<int>(std::lround(t.y)), t.s, t.c);
  }
  return std::move(c).take();
}

std::string num(double x) {
  char b[32];
  std::snprintf(b, sizeof b, "%.1f", x);
  return b;
}

std::string svg(const Display& d, const std::string& title) {
  using std::to_string;
  std::string o = "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" + to_string(d.w) + "\" height=\"" +
                  to_string(d.h) + "\" viewBox=\"0 0 " + to_string(d.w) + " " + to_string(d.h) +
                  "\" font-family=\"sans-serif\" font-size=\"11\">\n<title>" + explain::detail::xml_escape(title) +
                  "</title>\n<rect width=\"100%\" height=\"100%\" fill=\"#ffffff\"/>\n";
  // Consecutive segments of one colour and thickness become one polyline.
  for (std::size_t i = 0; i < d.lines.size();) {
    const Line& a = d.lines[i];
    std::string pts;
    auto point = [&](double x, double y) {
      if (!pts.empty()) pts.push_back(' ');
      pts.append(num(x)).push_back(',');
      pts.append(num(y));
    };
    point(a.x0, a.y0);
    point(a.x1, a.y1);
    std::size_t j = i + 1;
    while (j < d.lines.size() && d.lines[j].c == a.c && d.lines[j].thick == a.thick &&
           d.lines[j].x0 == d.lines[j - 1].x1 && d.lines[j].y0 == d.lines[j - 1].y1) {
      point(d.lines[j].x1, d.lines[j].y1);
      ++j;
    }
    o += "<polyline fill=\"none\" stroke=\"" + explain::detail::hex(a.c) + "\" stroke-width=\"" + to_string(a.thick) +
         "\" points=\"" + pts + "\"/>\n";
    i = j;
  }
  for (const Text& t : d.texts) {
    const char* anchor = t.anchor == 0 ? "start" : t.anchor == 1 ? "middle" : "end";
    if (t.up)
      o += "<text transform=\"translate(" + num(t.x + 9) + "," + num(t.y) + ") rotate(-90)\" fill=\"" +
           explain::detail::hex(t.c) + "\">" + explain::detail::xml_escape(t.s) + "</text>\n";
    else
      o += "<text x=\"" + num(t.x) + "\" y=\"" + num(t.y + 9) + "\" text-anchor=\"" + anchor + "\" fill=\"" +
           explain::detail::hex(t.c) + "\">" + explain::detail::xml_escape(t.s) + "</text>\n";
  }
  return o + "</svg>\n";
}

}  // namespace

std::vector<std::filesystem::path> write_study(const std::filesystem::path& dir, const std::vector<StudyRow>& rows,
                                               const StudyOptions& options) {
  if (rows.empty()) throw Error("study: expected at least one row to write");
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) throw Error("--out: cannot create directory '" + dir.string() + "': " + ec.message());
  std::vector<std::filesystem::path> written;
  detail::write_file_atomically(dir / "study.csv", study_csv(rows));
  written.push_back(dir / "study.csv");
  detail::write_file_atomically(dir / "summary.md", study_summary(rows, options));
  written.push_back(dir / "summary.md");
  const std::vector<Run> runs = study_detail::group_runs(rows);
  for (const Quantity& q : kQuantities) {
    const Display d = layout(q, runs, options);
    for (const char* ext : {".png", ".svg"}) {
      const std::filesystem::path p = dir / (std::string(q.file) + ext);
      explain::detail::write_figure(p, "figure", q.title, [&] { return raster(d); }, [&] { return svg(d, q.title); });
      written.push_back(p);
    }
  }
  return written;
}

}  // namespace qkv::train
