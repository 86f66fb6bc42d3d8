// Attention-weight heatmaps: a grid of per-head panels (query rows x key columns) with labels
// on both axes and one viridis colour bar, as PNG (raster, stb_image_write) or SVG/HTML (text
// kept as text). Both renderers share one layout so that they show the same picture.
#include <algorithm>
#include <cmath>
#include <string>

#include "explain/draw.hpp"
#include "qkv/error.hpp"
#include "qkv/explain.hpp"
#include "qkv/npy.hpp"

namespace qkv::explain {
namespace {

using detail::Rgb;


// viridis at t = 0, 1/9, ..., 1 (matplotlib's table sampled at 10 points), interpolated linearly
// in sRGB: within a few units of the 256-entry table.
constexpr std::uint8_t kViridis[10][3] = {
    {0x44, 0x01, 0x54}, {0x48, 0x28, 0x78}, {0x3e, 0x4a, 0x89}, {0x31, 0x68, 0x8e}, {0x26, 0x82, 0x8e},
    {0x1f, 0x9e, 0x89}, {0x35, 0xb7, 0x79}, {0x6d, 0xcd, 0x59}, {0xb4, 0xde, 0x2c}, {0xfd, 0xe7, 0x25}};

// The weights as a float64 [H, Sq, Sk] array.
struct Grid {
  std::int64_t H = 0, Sq = 0, Sk = 0;
  std::vector<double> w;
  double at(std::int64_t h, std::int64_t i, std::int64_t j) const {
    return w[static_cast<std::size_t>((h * Sq + i) * Sk + j)];
  }
};

Grid load_grid(const TensorView& weights) {
  if (weights.rank() != 2 && weights.rank() != 3)
    throw Error("weights: expected [H,Sq,Sk] or [Sq,Sk], got shape " + shape_str(weights.shape()));
  const DType d = weights.dtype();
  if (d != DType::f32 && d != DType::f64 && d != DType::f16 && d != DType::bf16)
    throw Error("weights: expected a float dtype, got " + std::string(dtype_name(d)));
  Grid g;
  g.H = weights.rank() == 3 ? weights.size(0) : 1;
  g.Sq = weights.size(weights.rank() - 2);
  g.Sk = weights.size(weights.rank() - 1);
  if (g.H < 1 || g.Sq < 1 || g.Sk < 1)
    throw Error("weights: expected at least one head, query and key, got shape " +
                shape_str(weights.shape()));
  checked_numel(weights.shape(), 8, "weights");
  if (g.H * g.Sq * g.Sk > kMaxTraceEntries)
    throw Error("weights: expected at most " + std::to_string(kMaxTraceEntries) + " entries, got shape " +
                shape_str(weights.shape()));
  const Tensor c = to_contiguous(weights, DType::f64);
  g.w.assign(c.data_as<const double>(), c.data_as<const double>() + c.numel());
  return g;
}

void check_labels(const std::vector<std::string>& l, std::int64_t n, const char* name, const char* axis) {
  if (!l.empty() && static_cast<std::int64_t>(l.size()) != n)
    throw Error(std::string(name) + ": expected " + axis + " = " + std::to_string(n) + " labels (or none), got " +
                std::to_string(static_cast<std::int64_t>(l.size())));
}

std::string label_at(const std::vector<std::string>& l, std::int64_t i) {
  return l.empty() ? std::to_string(i) : l[static_cast<std::size_t>(i)];
}

// The geometry shared by the PNG and SVG renderers, in pixels.
struct Layout {
  int cell = 0, label_step = 1;  // label every label_step-th row/column
  int row_label_w = 0, col_label_h = 0;
  int panel_w = 0, panel_h = 0, cols = 1, rows = 1;
  int title_h = 0, margin = 12, gap = 20, panel_title_h = 14;
  int bar_x = 0, bar_y = 0, bar_w = 16, bar_h = 0, bar_label_w = 0;
  int width = 0, height = 0;
  double vmin = 0, vmax = 1;
  int panel_x(std::int64_t h) const { return margin + static_cast<int>(h % cols) * (panel_w + gap); }
  int panel_y(std::int64_t h) const {
    return margin + title_h + static_cast<int>(h / cols) * (panel_h + gap);
  }
  // Top-left of the cells of panel h.
  int cells_x(std::int64_t h) const { return panel_x(h) + row_label_w; }
  int cells_y(std::int64_t h) const { return panel_y(h) + panel_title_h + col_label_h; }
};

constexpr std::size_t kLabelChars = 14;

Layout make_layout(const Grid& g, const std::vector<std::string>& rl, const std::vector<std::string>& cl,
                   const HeatmapOptions& o) {
  Layout L;
  const std::int64_t smax = std::max(g.Sq, g.Sk);
  L.cell = o.cell_px > 0 ? o.cell_px : static_cast<int>(std::clamp<std::int64_t>(480 / smax, 4, 32));
  if (L.cell > 256) throw Error("cell_px: expected at most 256, got " + std::to_string(L.cell));
  const int pitch = detail::kFontHeight + 2;  // a label needs this many pixels across
  L.label_step = L.cell >= pitch ? 1 : (pitch + L.cell - 1) / L.cell;
  int wr = 0, wc = 0;
  for (std::int64_t i = 0; i < g.Sq; i += L.label_step)
    wr = std::max(wr, detail::text_width(detail::ascii_label(label_at(rl, i), kLabelChars)));
  for (std::int64_t j = 0; j < g.Sk; j += L.label_step)
    wc = std::max(wc, detail::text_width(detail::ascii_label(label_at(cl, j), kLabelChars)));
  L.row_label_w = wr + 6;
  L.col_label_h = wc + 6;
  L.panel_w = L.row_label_w + static_cast<int>(g.Sk) * L.cell;
  L.panel_h = L.panel_title_h + L.col_label_h + static_cast<int>(g.Sq) * L.cell;
  L.cols =
      o.columns > 0 ? o.columns : static_cast<int>(std::ceil(std::sqrt(static_cast<double>(g.H)) - 1e-9));
  L.cols = static_cast<int>(std::clamp<std::int64_t>(L.cols, 1, g.H));
  L.rows = static_cast<int>((g.H + L.cols - 1) / L.cols);
  L.title_h = o.title.empty() ? 16 : 16 + 2 * detail::kFontHeight + 6;
  // Colour scale: [vmin, vmax], vmax defaulting to the largest finite weight.
  L.vmin = o.vmin;
  L.vmax = o.vmax;
  if (!(L.vmax > L.vmin)) {
    double mx = L.vmin;
    for (const double x : g.w)
      if (std::isfinite(x)) mx = std::max(mx, x);
    L.vmax = mx > L.vmin ? mx : L.vmin + 1.0;
  }
  const std::int64_t grid_w = static_cast<std::int64_t>(L.cols) * (L.panel_w + L.gap);
  const std::int64_t grid_h = static_cast<std::int64_t>(L.rows) * (L.panel_h + L.gap) - L.gap;
  L.bar_x = L.margin + static_cast<int>(std::min<std::int64_t>(grid_w, 1 << 20)) + 8;
  L.bar_y = L.margin + L.title_h + L.panel_title_h + L.col_label_h;
  L.bar_h = std::max(100, static_cast<int>(g.Sq) * L.cell);
  for (int t = 0; t <= 4; ++t)
    L.bar_label_w =
        std::max(L.bar_label_w, detail::text_width(detail::tick_label(L.vmin + (L.vmax - L.vmin) * t / 4)));
  L.bar_label_w = std::max(L.bar_label_w + 8, detail::text_width("weight"));
  const std::int64_t W = L.bar_x + L.bar_w + 6 + L.bar_label_w + L.margin;
  const std::int64_t Hh =
      std::max<std::int64_t>(L.margin + L.title_h + grid_h, L.bar_y + L.bar_h + 8) + L.margin;
  if (W * Hh > (std::int64_t{1} << 28))
    throw Error("weights: the heatmap would be " + std::to_string(W) + " x " + std::to_string(Hh) +
                " pixels, more than 2^28; use a smaller cell_px");
  L.width = static_cast<int>(W);
  L.height = static_cast<int>(Hh);
  return L;
}

Rgb colour(const Layout& L, double x) {
  if (std::isnan(x)) return detail::kGrey;
  return viridis((x - L.vmin) / (L.vmax - L.vmin));
}

std::string panel_title(const HeatmapOptions& o, std::int64_t h) {
  return h < static_cast<std::int64_t>(o.panel_titles.size()) ? o.panel_titles[static_cast<std::size_t>(h)]
                                                              : "head " + std::to_string(h);
}

constexpr const char* kCaption = "rows: queries i, columns: keys j, colour: weight alpha_ij";

}  // namespace

std::array<std::uint8_t, 3> viridis(double t) noexcept {
  if (!(t > 0.0)) t = 0.0;  // NaN too
  if (t > 1.0) t = 1.0;
  const double x = t * 9.0;
  const int k = std::min(static_cast<int>(x), 8);
  const double f = x - k;
  std::array<std::uint8_t, 3> c{};
  for (int ch = 0; ch < 3; ++ch)
    c[static_cast<std::size_t>(ch)] =
        static_cast<std::uint8_t>(std::lround(kViridis[k][ch] + f * (kViridis[k + 1][ch] - kViridis[k][ch])));
  return c;
}

Image render_heatmap(const TensorView& weights, const std::vector<std::string>& row_labels,
                     const std::vector<std::string>& col_labels, const HeatmapOptions& o) {
  const Grid g = load_grid(weights);
  check_labels(row_labels, g.Sq, "row_labels", "Sq");
  check_labels(col_labels, g.Sk, "col_labels", "Sk");
  const Layout L = make_layout(g, row_labels, col_labels, o);
  detail::Canvas c(L.width, L.height);
  if (!o.title.empty()) {
    c.text(L.margin, L.margin, detail::ascii_label(o.title, 200), detail::kBlack, 2);
    c.text(L.margin, L.margin + 2 * detail::kFontHeight + 4, kCaption, detail::kGrey);
  } else {
    c.text(L.margin, L.margin, kCaption, detail::kGrey);
  }
  for (std::int64_t h = 0; h < g.H; ++h) {
    const int x0 = L.cells_x(h), y0 = L.cells_y(h);
    c.text(L.panel_x(h), L.panel_y(h), detail::ascii_label(panel_title(o, h), 40), detail::kBlack);
    for (std::int64_t i = 0; i < g.Sq; ++i)
      for (std::int64_t j = 0; j < g.Sk; ++j)
        c.fill(x0 + static_cast<int>(j) * L.cell, y0 + static_cast<int>(i) * L.cell,
               x0 + static_cast<int>(j + 1) * L.cell, y0 + static_cast<int>(i + 1) * L.cell,
               colour(L, g.at(h, i, j)));
    // Row labels right-aligned against the cells, centred on their row.
    for (std::int64_t i = 0; i < g.Sq; i += L.label_step) {
      const std::string t = detail::ascii_label(label_at(row_labels, i), kLabelChars);
      c.text(x0 - 4 - detail::text_width(t), y0 + static_cast<int>(i) * L.cell + (L.cell - 7) / 2, t,
             detail::kBlack);
    }
    // Column labels read upwards, ending just above the cells.
    for (std::int64_t j = 0; j < g.Sk; j += L.label_step) {
      const std::string t = detail::ascii_label(label_at(col_labels, j), kLabelChars);
      c.text_up(x0 + static_cast<int>(j) * L.cell + (L.cell - 7) / 2, y0 - 4, t, detail::kBlack);
    }
  }
  // Colour bar: vmax at the top, vmin at the bottom, five ticks.
  c.text(L.bar_x, L.bar_y - detail::kFontHeight - 6, "weight", detail::kBlack);
  for (int y = 0; y < L.bar_h; ++y) {
    const double t = 1.0 - static_cast<double>(y) / (L.bar_h - 1);
    c.fill(L.bar_x, L.bar_y + y, L.bar_x + L.bar_w, L.bar_y + y + 1, viridis(t));
  }
  for (int t = 0; t <= 4; ++t) {
    const int y = L.bar_y + static_cast<int>(std::lround((L.bar_h - 1) * (1.0 - t / 4.0)));
    c.fill(L.bar_x + L.bar_w, y, L.bar_x + L.bar_w + 4, y + 1, detail::kBlack);
    c.text(L.bar_x + L.bar_w + 6, y - 3, detail::tick_label(L.vmin + (L.vmax - L.vmin) * t / 4.0),
           detail::kBlack);
  }
  return std::move(c).take();
}

std::string heatmap_svg(const TensorView& weights, const std::vector<std::string>& row_labels,
                        const std::vector<std::string>& col_labels, const HeatmapOptions& o) {
  const Grid g = load_grid(weights);
  check_labels(row_labels, g.Sq, "row_labels", "Sq");
  check_labels(col_labels, g.Sk, "col_labels", "Sk");
  const Layout L = make_layout(g, row_labels, col_labels, o);
  using detail::xml_escape;
  std::string out;
  out.reserve(static_cast<std::size_t>(g.H * g.Sq * g.Sk) * 96 + 4096);
  out += "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" + std::to_string(L.width) + "\" height=\"" + std::to_string(L.height) +
         "\" viewBox=\"0 0 " + std::to_string(L.width) + " " + std::to_string(L.height) +
         "\" font-family=\"monospace\" font-size=\"10\">\n";
  out += "<rect width=\"100%\" height=\"100%\" fill=\"#ffffff\"/>\n";
  out += "<defs><linearGradient id=\"viridis\" x1=\"0\" y1=\"1\" x2=\"0\" y2=\"0\">";
  for (int t = 0; t <= 20; ++t)
    out += "<stop offset=\"" + detail::tick_label(t / 20.0) + "\" stop-color=\"" +
           detail::hex(viridis(t / 20.0)) + "\"/>";
  out += "</linearGradient></defs>\n";
  int cap_y = L.margin + 10;
  if (!o.title.empty()) {
    out += "<text x=\"" + std::to_string(L.margin) + "\" y=\"" + std::to_string(L.margin + 14) +
           "\" font-size=\"16\" font-family=\"sans-serif\">" + xml_escape(o.title) + "</text>\n";
    cap_y = L.margin + 2 * detail::kFontHeight + 4 + 9;
  }
  out += "<text x=\"" + std::to_string(L.margin) + "\" y=\"" + std::to_string(cap_y) + "\" fill=\"#808080\">" + kCaption + "</text>\n";
  char buf[160];
  for (std::int64_t h = 0; h < g.H; ++h) {
    const int x0 = L.cells_x(h), y0 = L.cells_y(h);
    out += "<g class=\"panel\" id=\"head" + std::to_string(h) + "\">\n<text x=\"" + std::to_string(L.panel_x(h)) + "\" y=\"" +
           std::to_string(L.panel_y(h) + 9) + "\">" + xml_escape(panel_title(o, h)) + "</text>\n";
    for (std::int64_t i = 0; i < g.Sq; ++i)
      for (std::int64_t j = 0; j < g.Sk; ++j) {
        const double w = g.at(h, i, j);
        std::snprintf(buf, sizeof buf,
                      "<rect class=\"cell\" x=\"%d\" y=\"%d\" width=\"%d\" height=\"%d\" fill=\"%s\">",
                      x0 + static_cast<int>(j) * L.cell, y0 + static_cast<int>(i) * L.cell, L.cell, L.cell,
                      detail::hex(colour(L, w)).c_str());
        out += buf;
        std::snprintf(buf, sizeof buf, "%.6g", w);
        out += "<title>query " + std::to_string(i) + " " + xml_escape(label_at(row_labels, i)) + " -> key " + std::to_string(j) + " " +
               xml_escape(label_at(col_labels, j)) + ": " + buf + "</title></rect>\n";
      }
    for (std::int64_t i = 0; i < g.Sq; i += L.label_step)
      out += "<text class=\"row-label\" x=\"" + std::to_string(x0 - 4) + "\" y=\"" +
             std::to_string(y0 + static_cast<int>(i) * L.cell + L.cell / 2 + 3) + "\" text-anchor=\"end\">" +
             xml_escape(label_at(row_labels, i)) + "</text>\n";
    for (std::int64_t j = 0; j < g.Sk; j += L.label_step) {
      const int x = x0 + static_cast<int>(j) * L.cell + L.cell / 2 + 3, y = y0 - 4;
      out += "<text class=\"col-label\" x=\"" + std::to_string(x) + "\" y=\"" + std::to_string(y) + "\" transform=\"rotate(-90 " +
             std::to_string(x) + " " + std::to_string(y) + ")\">" + xml_escape(label_at(col_labels, j)) + "</text>\n";
    }
    out += "</g>\n";
  }
  out += "<text x=\"" + std::to_string(L.bar_x) + "\" y=\"" + std::to_string(L.bar_y - 6) + "\">weight</text>\n";
  out += "<rect class=\"colorbar\" x=\"" + std::to_string(L.bar_x) + "\" y=\"" + std::to_string(L.bar_y) + "\" width=\"" + std::to_string(L.bar_w) +
         "\" height=\"" + std::to_string(L.bar_h) + "\" fill=\"url(#viridis)\"/>\n";
  for (int t = 0; t <= 4; ++t) {
    const int y = L.bar_y + static_cast<int>(std::lround((L.bar_h - 1) * (1.0 - t / 4.0)));
    out += "<line x1=\"" + std::to_string(L.bar_x + L.bar_w) + "\" y1=\"" + std::to_string(y) + "\" x2=\"" + std::to_string(L.bar_x + L.bar_w + 4) +
           "\" y2=\"" + std::to_string(y) + "\" stroke=\"#000\"/><text class=\"tick\" x=\"" + std::to_string(L.bar_x + L.bar_w + 6) +
           "\" y=\"" + std::to_string(y + 3) + "\">" + detail::tick_label(L.vmin + (L.vmax - L.vmin) * t / 4.0) +
           "</text>\n";
  }
  out += "</svg>\n";
  return out;
}

void write_heatmap(const std::filesystem::path& path, const TensorView& weights,
                   const std::vector<std::string>& row_labels, const std::vector<std::string>& col_labels,
                   const HeatmapOptions& o) {
  detail::write_figure(
      path, "heatmap", o.title.empty() ? "attention weights" : o.title,
      [&] { return render_heatmap(weights, row_labels, col_labels, o); },
      [&] { return heatmap_svg(weights, row_labels, col_labels, o); });
}

}  // namespace qkv::explain
