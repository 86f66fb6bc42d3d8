#pragma once
// Minimal raster and SVG drawing for the heatmaps and plots of qkv::explain: filled
// rectangles, thick lines, and text from stb_easy_font (public domain bitmap glyphs built from
// axis-aligned quads, ASCII only), horizontal or rotated a quarter turn.
#include <array>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <string>
#include <vector>

#include "qkv/explain.hpp"

namespace qkv::explain::detail {

using Rgb = std::array<std::uint8_t, 3>;
inline constexpr Rgb kWhite{255, 255, 255}, kBlack{0, 0, 0}, kGrey{128, 128, 128}, kLight{220, 220, 220};

/// Height in pixels of one line of easy_font text at scale 1 (glyphs are 7 px tall; ascii only).
inline constexpr int kFontHeight = 8;

class Canvas {
 public:
  /// @throws qkv::Error above 2^28 pixels.
  Canvas(int width, int height, Rgb background = kWhite);
  int width() const noexcept { return w_; }
  int height() const noexcept { return h_; }
  /// Fills [x0, x1) x [y0, y1), clipped.
  void fill(int x0, int y0, int x1, int y1, Rgb c);
  /// A line of `thickness` pixels from (x0, y0) to (x1, y1).
  void line(double x0, double y0, double x1, double y1, Rgb c, int thickness = 1);
  /// Text with its top-left corner at (x, y); returns its width.
  int text(int x, int y, const std::string& s, Rgb c, int scale = 1);
  /// Text read bottom to top (rotated a quarter turn counter-clockwise), its first character's
  /// baseline corner at (x, y_bottom): occupies [x, x + height) x (y_bottom - width, y_bottom].
  void text_up(int x, int y_bottom, const std::string& s, Rgb c, int scale = 1);
  Image take() &&;

 private:
  int w_, h_;
  std::vector<std::uint8_t> px_;
};

/// Width in pixels of `s` at scale 1 (non-ASCII bytes count as '?').
int text_width(const std::string& s);
/// `s` with bytes outside printable ASCII replaced by '?' (U+2581 by '_'), cut to `max_chars` (with "..").
std::string ascii_label(const std::string& s, std::size_t max_chars = 14);
/// XML text escaping (&, <, >, ", ').
std::string xml_escape(const std::string& s);
/// "#rrggbb".
std::string hex(Rgb c);
/// %.3g without a trailing exponent mess: "0.25", "1", "1e-05".
std::string tick_label(double x);
/// Lower-case extension of a path, with the dot (".png").
std::string extension_of(const std::filesystem::path& p);
/// A page holding one SVG document.
std::string html_page(const std::string& title, const std::string& svg);
/// Writes a figure by the extension of `path`: .png (`raster`, encoded), .svg or .html (a page
/// titled `title`) from `svg`, atomically. @throws qkv::Error naming `what` for another extension.
void write_figure(const std::filesystem::path& path, const char* what, const std::string& title,
                  const std::function<Image()>& raster, const std::function<std::string()>& svg);

}  // namespace qkv::explain::detail
