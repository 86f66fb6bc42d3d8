// Raster/SVG drawing helpers and file output for qkv::explain (see draw.hpp).
#include "explain/draw.hpp"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <system_error>

#include "io/atomic_file.hpp"
#include "qkv/error.hpp"

// stb_easy_font defines only static functions (v1.1), so including it here is self-contained.
#include <stb/stb_easy_font.h>

#define STB_IMAGE_WRITE_IMPLEMENTATION
#define STB_IMAGE_WRITE_STATIC
#include <stb/stb_image_write.h>

namespace qkv::explain {
namespace detail {

Canvas::Canvas(int width, int height, Rgb background) : w_(width), h_(height) {
  if (width <= 0 || height <= 0 || static_cast<std::int64_t>(width) * height > (std::int64_t{1} << 28))
    throw Error("image: expected 1 .. 2^28 pixels, got " + std::to_string(width) + " x " +
                std::to_string(height));
  px_.resize(static_cast<std::size_t>(width) * static_cast<std::size_t>(height) * 3);
  for (std::size_t p = 0; p < px_.size(); p += 3)
    std::copy(background.begin(), background.end(), px_.begin() + static_cast<std::ptrdiff_t>(p));
}

void Canvas::fill(int x0, int y0, int x1, int y1, Rgb c) {
  x0 = std::max(x0, 0);
  y0 = std::max(y0, 0);
  x1 = std::min(x1, w_);
  y1 = std::min(y1, h_);
  for (int y = y0; y < y1; ++y)
    for (int x = x0; x < x1; ++x) {
      auto* p =
          &px_[(static_cast<std::size_t>(y) * static_cast<std::size_t>(w_) + static_cast<std::size_t>(x)) *
               3];
      p[0] = c[0];
      p[1] = c[1];
      p[2] = c[2];
    }
}

void Canvas::line(double x0, double y0, double x1, double y1, Rgb c, int thickness) {
  // Sample the segment at sub-pixel steps and stamp a square: simple, and exact enough for plots.
  const double len = std::hypot(x1 - x0, y1 - y0);
  const int steps = std::max(1, static_cast<int>(std::ceil(len * 2)));
  const int r0 = -(thickness - 1) / 2, r1 = thickness / 2 + 1;
  for (int s = 0; s <= steps; ++s) {
    const double t = static_cast<double>(s) / steps;
    const int x = static_cast<int>(std::lround(x0 + t * (x1 - x0))),
              y = static_cast<int>(std::lround(y0 + t * (y1 - y0)));
    fill(x + r0, y + r0, x + r1, y + r1, c);
  }
}

namespace {
// The quads of `s` at scale 1, origin (0, 0): {x0, y0, x1, y1} each.
std::vector<std::array<float, 4>> glyph_quads(const std::string& s) {
  std::string a = ascii_label(s, s.size());
  std::vector<char> vbuf(a.size() * 300 + 64);
  const int n = stb_easy_font_print(0, 0, a.data(), nullptr, vbuf.data(), static_cast<int>(vbuf.size()));
  std::vector<std::array<float, 4>> q(static_cast<std::size_t>(n));
  for (int k = 0; k < n; ++k) {
    const float* v0 = reinterpret_cast<const float*>(vbuf.data() + k * 64);
    const float* v2 = reinterpret_cast<const float*>(vbuf.data() + k * 64 + 32);
    q[static_cast<std::size_t>(k)] = {v0[0], v0[1], v2[0], v2[1]};
  }
  return q;
}
}  // namespace

int Canvas::text(int x, int y, const std::string& s, Rgb c, int scale) {
  for (const auto& q : glyph_quads(s))
    fill(x + static_cast<int>(q[0]) * scale, y + static_cast<int>(q[1]) * scale,
         x + static_cast<int>(q[2]) * scale, y + static_cast<int>(q[3]) * scale, c);
  return text_width(s) * scale;
}

void Canvas::text_up(int x, int y_bottom, const std::string& s, Rgb c, int scale) {
  // A glyph point (u, v) (u along the text, v down) lands at (x + v, y_bottom - u).
  for (const auto& q : glyph_quads(s)) {
    const int u0 = static_cast<int>(q[0]) * scale, v0 = static_cast<int>(q[1]) * scale;
    const int u1 = static_cast<int>(q[2]) * scale, v1 = static_cast<int>(q[3]) * scale;
    fill(x + v0, y_bottom - u1 + 1, x + v1, y_bottom - u0 + 1, c);
  }
}

Image Canvas::take() && {
  Image im;
  im.width = w_;
  im.height = h_;
  im.rgb = std::move(px_);
  return im;
}

int text_width(const std::string& s) {
  std::string a = ascii_label(s, s.size());
  return a.empty() ? 0 : stb_easy_font_width(a.data());
}

std::string ascii_label(const std::string& s, std::size_t max_chars) {
  std::string a;
  for (std::size_t k = 0; k < s.size(); ++k) {
    const char ch = s[k];
    const auto u = static_cast<unsigned char>(ch);
    // SentencePiece marks a word start with U+2581 (bytes E2 96 81): show it as '_'.
    if (s.compare(k, 3, "\xe2\x96\x81") == 0) {
      a += '_';
      k += 2;
      continue;
    }
    // A UTF-8 sequence becomes one '?': skip its continuation bytes.
    if ((u & 0xC0) == 0x80) continue;
    a += (u >= 32 && u < 127) ? ch : '?';
  }
  if (a.size() > max_chars) a = a.substr(0, max_chars >= 2 ? max_chars - 2 : 0) + "..";
  return a;
}

std::string xml_escape(const std::string& s) {
  std::string o;
  for (const char ch : s) {
    switch (ch) {
      case '&':
        o += "&amp;";
        break;
      case '<':
        o += "&lt;";
        break;
      case '>':
        o += "&gt;";
        break;
      case '"':
        o += "&quot;";
        break;
      case '\'':
        o += "&apos;";
        break;
      default:
        // Control characters are not allowed in XML 1.0.
        if (static_cast<unsigned char>(ch) < 32 && ch != '\t' && ch != '\n')
          o += ' ';
        else
          o += ch;
    }
  }
  return o;
}

std::string hex(Rgb c) {
  char buf[8];
  std::snprintf(buf, sizeof buf, "#%02x%02x%02x", c[0], c[1], c[2]);
  return buf;
}

std::string tick_label(double x) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.3g", std::abs(x) < 1e-12 ? 0.0 : x);
  return buf;
}

std::string extension_of(const std::filesystem::path& p) {
  std::string e = p.extension().string();
  std::transform(e.begin(), e.end(), e.begin(),
                 [](unsigned char ch) { return static_cast<char>(std::tolower(ch)); });
  return e;
}

std::string html_page(const std::string& title, const std::string& svg) {
  return "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n<title>" +
         xml_escape(title) +
         "</title>\n<style>body{font-family:sans-serif;margin:16px;background:#fff}</style>\n</"
         "head>\n<body>\n" +
         svg + "\n</body>\n</html>\n";
}

}  // namespace detail

std::vector<std::uint8_t> encode_png(const Image& image) {
  if (image.width <= 0 || image.height <= 0 ||
      image.rgb.size() != static_cast<std::size_t>(image.width) * static_cast<std::size_t>(image.height) * 3)
    throw Error("image: expected width x height x 3 bytes, got " + std::to_string(image.rgb.size()) +
                " for " + std::to_string(image.width) + " x " + std::to_string(image.height));
  std::vector<std::uint8_t> out;
  auto sink = [](void* ctx, void* data, int size) {
    auto* v = static_cast<std::vector<std::uint8_t>*>(ctx);
    const auto* d = static_cast<const std::uint8_t*>(data);
    v->insert(v->end(), d, d + size);
  };
  if (!stbi_write_png_to_func(sink, &out, image.width, image.height, 3, image.rgb.data(), image.width * 3))
    throw Error("image: PNG encoding failed");
  return out;
}

namespace detail {

void write_figure(const std::filesystem::path& path, const char* what, const std::string& title,
                  const std::function<Image()>& raster, const std::function<std::string()>& svg) {
  const std::string ext = extension_of(path);
  std::string bytes;
  if (ext == ".png") {
    const auto png = encode_png(raster());
    bytes.assign(png.begin(), png.end());
  } else if (ext == ".svg") {
    bytes = "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n" + svg();
  } else if (ext == ".html" || ext == ".htm") {
    bytes = html_page(title, svg());
  } else {
    throw Error(std::string(what) + ": expected a file name ending in .png, .svg or .html, got '" + path.string() + "'");
  }
  qkv::detail::write_file_atomically(path, bytes);
}

}  // namespace detail

}  // namespace qkv::explain
