//! Images to pixel patches, as transformers' Qwen2VL image processor (PIL backend) makes them, from the
//! checkpoint's `preprocessor_config.json`:
//!
//! 1. decode (PNG or JPEG) and convert to 8-bit RGB;
//! 2. resize to a multiple of `patch_size · merge_size` within the pixel bounds (`smart_resize`: the nearest
//!    multiple, rounding half to even as Python's `round` does, scaled down to `max_pixels` or up to `min_pixels`
//!    keeping the aspect ratio), or to a fixed size (`--image-size`, the NPU port's 512×512), with a bicubic
//!    convolution as Pillow resamples (Catmull-Rom, `a = −0.5`, widened when shrinking; `fast_image_resize`), the
//!    result rounded to 8 bits as Pillow's is;
//! 3. rescale (`x · rescale_factor` in f64, then to f32) and normalise (`(x − mean) / std` in f32) per channel;
//! 4. patchify into transformers' `pixel_values` order: merge block by merge block, each patch's channels, its
//!    frames (an image repeated `temporal_patch_size` times) and its rows of pixels.

use crate::error::{Error, Result};
use crate::vision::Grid;
use candle_core::{Device, Tensor};
use serde_json::Value;
use std::path::Path;

/// An 8-bit RGB image, row-major, three bytes per pixel.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RgbImage {
    /// Width in pixels.
    pub width: usize,
    /// Height in pixels.
    pub height: usize,
    /// `height · width · 3` bytes.
    pub pixels: Vec<u8>,
}

impl RgbImage {
    /// Decodes a PNG or JPEG file (any colour type, converted to RGB as PIL's `convert("RGB")` does for opaque
    /// images).
    pub fn open(path: &Path) -> Result<Self> {
        let file = crate::inputs::open(path).map_err(|e| Error::io(path, e))?;
        let img = image::ImageReader::new(std::io::BufReader::new(file))
            .with_guessed_format()
            .map_err(|e| Error::io(path, e))?
            .decode()
            .map_err(|e| Error::File {
                file: path.display().to_string(),
                message: format!("not a PNG or JPEG image this build can decode: {e}"),
            })?
            .to_rgb8();
        Ok(RgbImage {
            width: img.width() as usize,
            height: img.height() as usize,
            pixels: img.into_raw(),
        })
    }

    /// A PNG or JPEG file's `(width, height)`, read from its header without decoding it: what decoding it would
    /// allocate is known before it is.
    pub fn dimensions(path: &Path) -> Result<(usize, usize)> {
        let file = crate::inputs::open(path).map_err(|e| Error::io(path, e))?;
        let (w, h) = image::ImageReader::new(std::io::BufReader::new(file))
            .with_guessed_format()
            .map_err(|e| Error::io(path, e))?
            .into_dimensions()
            .map_err(|e| Error::File {
                file: path.display().to_string(),
                message: format!("not a PNG or JPEG image this build can decode: {e}"),
            })?;
        Ok((w as usize, h as usize))
    }

    /// The image resampled to `width × height` with Pillow's bicubic convolution: the rows first, then the columns,
    /// each pass rounded to 8 bits, as Pillow orders them (`fast_image_resize` alone would take the columns first,
    /// which moves the result by up to 9 levels on the test images); the image itself when a side keeps its size.
    pub fn resized(&self, width: usize, height: usize) -> Result<Self> {
        let rows_done = self.resample(width, self.height)?;
        rows_done.resample(width, height)
    }

    /// One resampling pass with `fast_image_resize`'s Catmull-Rom convolution (Pillow's bicubic, `a = −0.5`).
    /// The typed resize of three-byte pixels: the untyped one would compile every pixel type's kernels into this
    /// crate, half of its machine code.
    fn resample(&self, width: usize, height: usize) -> Result<Self> {
        use fast_image_resize::images::{TypedImage, TypedImageRef};
        use fast_image_resize::{FilterType, ResizeAlg, ResizeOptions, Resizer, pixels::U8x3};
        if (width, height) == (self.width, self.height) {
            return Ok(self.clone());
        }
        let fail = |e: String| Error::Input(format!("resizing an image to {width}x{height}: {e}"));
        let src =
            TypedImageRef::<U8x3>::from_buffer(self.width as u32, self.height as u32, &self.pixels)
                .map_err(|e| fail(e.to_string()))?;
        let mut pixels = vec![0u8; width * height * 3];
        let mut dst = TypedImage::<U8x3>::from_buffer(width as u32, height as u32, &mut pixels)
            .map_err(|e| fail(e.to_string()))?;
        let opts = ResizeOptions::new().resize_alg(ResizeAlg::Convolution(FilterType::CatmullRom));
        Resizer::new()
            .resize_typed(&src, &mut dst, &opts)
            .map_err(|e| fail(e.to_string()))?;
        Ok(RgbImage {
            width,
            height,
            pixels,
        })
    }
}

/// `preprocessor_config.json` of a Qwen2VL-style image processor.
#[derive(Debug, Clone, PartialEq)]
pub struct Preprocessor {
    /// Side of a patch in pixels.
    pub patch_size: usize,
    /// Frames per patch.
    pub temporal_patch_size: usize,
    /// Side of a merge block in patches.
    pub merge_size: usize,
    /// The fewest pixels a resized image holds (`size.shortest_edge`, or `min_pixels`).
    pub min_pixels: usize,
    /// The most pixels a resized image holds (`size.longest_edge`, or `max_pixels`).
    pub max_pixels: usize,
    /// Whether images are resized (`do_resize`, true unless the file says otherwise, as transformers' class).
    pub do_resize: bool,
    /// The factor of `do_rescale` (`rescale_factor`, 1/255 unless given, as transformers' class), `None` when off.
    pub rescale: Option<f64>,
    /// Per-channel `(mean, std)` of `do_normalize`, `None` when off.
    pub normalize: Option<([f32; 3], [f32; 3])>,
}

impl Preprocessor {
    /// Reads the checkpoint directory's `preprocessor_config.json`.
    pub fn from_dir(dir: &Path) -> Result<Self> {
        let path = dir.join("preprocessor_config.json");
        let text = crate::inputs::read_to_string(&path).map_err(|e| Error::io(&path, e))?;
        Self::from_json_str(&text, &path.display().to_string())
    }

    /// Parses a `preprocessor_config.json`; `source` names the file in errors.
    pub fn from_json_str(text: &str, source: &str) -> Result<Self> {
        let err = |key: &str, message: String| Error::Config {
            file: source.to_string(),
            key: key.to_string(),
            message,
        };
        let v: Value = serde_json::from_str(text).map_err(|e| Error::File {
            file: source.to_string(),
            message: format!("not valid JSON: {e}"),
        })?;
        let get = |key: &str| v.get(key).filter(|x| !x.is_null());
        let count = |key: &str, x: Option<&Value>| -> Result<usize> {
            let x = x.ok_or_else(|| err(key, "missing (no default is assumed)".into()))?;
            match x.as_u64() {
                Some(n) if n > 0 => Ok(n as usize),
                _ => Err(err(key, format!("expected a positive integer, found {x}"))),
            }
        };
        let flag = |key: &str| -> Result<bool> {
            match get(key) {
                None => Ok(true),
                Some(x) => x
                    .as_bool()
                    .ok_or_else(|| err(key, format!("expected true or false, found {x}"))),
            }
        };
        if let Some(r) = get("resample")
            && r.as_u64() != Some(3)
        {
            return Err(err(
                "resample",
                format!("only bicubic (3) is implemented, found {r}"),
            ));
        }
        let size = get("size");
        let bound = |new: &str, old: &str| -> Result<usize> {
            match size.and_then(|s| s.get(new)).filter(|x| !x.is_null()) {
                Some(x) => count(&format!("size.{new}"), Some(x)),
                None => count(old, get(old)),
            }
        };
        let triple = |key: &str| -> Result<[f32; 3]> {
            let x = get(key).ok_or_else(|| err(key, "missing (no default is assumed)".into()))?;
            let a = x
                .as_array()
                .filter(|a| a.len() == 3)
                .ok_or_else(|| err(key, format!("expected three numbers (R, G, B), found {x}")))?;
            let mut out = [0f32; 3];
            for (o, n) in out.iter_mut().zip(a) {
                *o = n
                    .as_f64()
                    .ok_or_else(|| err(key, format!("{n} is not a number")))?
                    as f32;
            }
            Ok(out)
        };
        let patch_size = count("patch_size", get("patch_size"))?;
        let temporal_patch_size = count("temporal_patch_size", get("temporal_patch_size"))?;
        let merge_size = count("merge_size", get("merge_size"))?;
        let rescale = if flag("do_rescale")? {
            Some(match get("rescale_factor") {
                None => 1.0 / 255.0,
                Some(x) => x.as_f64().ok_or_else(|| {
                    err("rescale_factor", format!("expected a number, found {x}"))
                })?,
            })
        } else {
            None
        };
        let normalize = if flag("do_normalize")? {
            let std = triple("image_std")?;
            if std.contains(&0.0) {
                return Err(err("image_std", "a standard deviation of 0".into()));
            }
            Some((triple("image_mean")?, std))
        } else {
            None
        };
        let p = Preprocessor {
            patch_size,
            temporal_patch_size,
            merge_size,
            min_pixels: bound("shortest_edge", "min_pixels")?,
            max_pixels: bound("longest_edge", "max_pixels")?,
            do_resize: flag("do_resize")?,
            rescale,
            normalize,
        };
        if p.min_pixels > p.max_pixels {
            return Err(err(
                "size",
                format!(
                    "the pixel bounds are inverted: at least {} and at most {}",
                    p.min_pixels, p.max_pixels
                ),
            ));
        }
        Ok(p)
    }

    /// The multiple every resized side is of (`patch_size · merge_size`).
    pub fn factor(&self) -> usize {
        self.patch_size * self.merge_size
    }

    /// transformers' `smart_resize`: the size `(height, width)` an image of `height × width` is resized to.
    pub fn target_size(&self, height: usize, width: usize) -> Result<(usize, usize)> {
        let (h, w, f) = (height as f64, width as f64, self.factor() as f64);
        if height == 0 || width == 0 {
            return Err(Error::Input(format!("an empty {width}x{height} image")));
        }
        if h.max(w) / h.min(w) > 200.0 {
            return Err(Error::Input(format!(
                "a {width}x{height} image: the aspect ratio must be under 200 (transformers refuses it too)"
            )));
        }
        let mut hb = (h / f).round_ties_even() * f;
        let mut wb = (w / f).round_ties_even() * f;
        if hb * wb > self.max_pixels as f64 {
            let beta = (h * w / self.max_pixels as f64).sqrt();
            hb = f.max((h / beta / f).floor() * f);
            wb = f.max((w / beta / f).floor() * f);
        } else if hb * wb < self.min_pixels as f64 {
            let beta = (self.min_pixels as f64 / (h * w)).sqrt();
            hb = (h * beta / f).ceil() * f;
            wb = (w * beta / f).ceil() * f;
        }
        Ok((hb as usize, wb as usize))
    }

    /// The pixel patches `[Σ patches, 3 · Tp · P · P]` (f32) of `images` and their grids, each resized as the
    /// processor does, or to `fixed` `(width, height)` when given (which must be whole merge blocks).
    pub fn pixel_values(
        &self,
        images: &[RgbImage],
        fixed: Option<(usize, usize)>,
    ) -> Result<(Tensor, Vec<Grid>)> {
        let f = self.factor();
        let mut values = Vec::new();
        let mut grids = Vec::new();
        for img in images {
            let (h, w) = match fixed {
                Some((w, h)) => {
                    if w == 0 || h == 0 || !w.is_multiple_of(f) || !h.is_multiple_of(f) {
                        return Err(Error::Input(format!(
                            "--image-size {w}x{h}: both sides must be positive multiples of {f} (patch {} x \
                             merge {})",
                            self.patch_size, self.merge_size
                        )));
                    }
                    (h, w)
                }
                None if self.do_resize => self.target_size(img.height, img.width)?,
                None => (img.height, img.width),
            };
            if !h.is_multiple_of(f) || !w.is_multiple_of(f) {
                return Err(Error::Input(format!(
                    "a {}x{} image is not resized (do_resize false) and is not whole {f}-pixel merge blocks",
                    img.width, img.height
                )));
            }
            let resized = img.resized(w, h)?;
            grids.push(self.patchify(&self.planes(&resized), h, w, &mut values));
        }
        let n: usize = grids.iter().map(Grid::patches).sum();
        let dim = 3 * self.temporal_patch_size * self.patch_size * self.patch_size;
        Ok((Tensor::from_vec(values, (n, dim), &Device::Cpu)?, grids))
    }

    /// The image as three f32 planes, rescaled and normalised.
    fn planes(&self, img: &RgbImage) -> Vec<f32> {
        let n = img.width * img.height;
        let mut out = vec![0f32; 3 * n];
        for (i, px) in img.pixels.chunks_exact(3).enumerate() {
            for c in 0..3 {
                let mut x = match self.rescale {
                    Some(s) => (px[c] as f64 * s) as f32,
                    None => px[c] as f32,
                };
                if let Some((mean, std)) = &self.normalize {
                    x = (x - mean[c]) / std[c];
                }
                out[c * n + i] = x;
            }
        }
        out
    }

    /// Appends the patches of `planes` (`3 × h × w`) in the processor's order; returns the grid.
    fn patchify(&self, planes: &[f32], h: usize, w: usize, out: &mut Vec<f32>) -> Grid {
        let (p, m, tp) = (self.patch_size, self.merge_size, self.temporal_patch_size);
        let (gh, gw) = (h / p, w / p);
        for br in 0..gh / m {
            for bc in 0..gw / m {
                for ir in 0..m {
                    for ic in 0..m {
                        let (row, col) = ((br * m + ir) * p, (bc * m + ic) * p);
                        for c in 0..3 {
                            for _ in 0..tp {
                                for y in 0..p {
                                    let start = c * h * w + (row + y) * w + col;
                                    out.extend_from_slice(&planes[start..start + p]);
                                }
                            }
                        }
                    }
                }
            }
        }
        Grid { t: 1, h: gh, w: gw }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tiny() -> Preprocessor {
        Preprocessor::from_json_str(
            r#"{"patch_size": 4, "temporal_patch_size": 2, "merge_size": 2, "image_mean": [0.5, 0.5, 0.5],
                "image_std": [0.5, 0.5, 0.5], "size": {"shortest_edge": 64, "longest_edge": 4096}}"#,
            "p.json",
        )
        .unwrap()
    }

    #[test]
    fn smart_resize_rounds_half_to_even_and_keeps_the_bounds() {
        let p = tiny();
        // 20 / 8 = 2.5 rounds to 2 (Python's round), 13 / 8 = 1.625 to 2.
        assert_eq!(p.target_size(13, 20).unwrap(), (16, 16));
        assert_eq!(p.target_size(29, 37).unwrap(), (32, 40));
        // Too many pixels: scaled down to fit 4096, whole blocks.
        let (h, w) = p.target_size(200, 100).unwrap();
        assert!(h * w <= 4096 && h % 8 == 0 && w % 8 == 0, "{h}x{w}");
        // Too few: scaled up to reach 64.
        let (h, w) = p.target_size(3, 3).unwrap();
        assert!(h * w >= 64, "{h}x{w}");
        assert!(p.target_size(1, 300).is_err());
    }

    #[test]
    fn patches_follow_the_processors_order() {
        let mut p = tiny();
        p.normalize = None;
        p.rescale = None;
        // An 8x8 image whose red channel is its pixel index: one merge block of four 4x4 patches.
        let pixels: Vec<u8> = (0..64u8).flat_map(|i| [i, 0, 0]).collect();
        let img = RgbImage {
            width: 8,
            height: 8,
            pixels,
        };
        let (v, grids) = p.pixel_values(&[img], None).unwrap();
        assert_eq!(grids, vec![Grid { t: 1, h: 2, w: 2 }]);
        let v: Vec<Vec<f32>> = v.to_vec2().unwrap();
        // Patch 1 (top right): red rows start at pixels 4, 12, 20, 28; both frames the same.
        assert_eq!(&v[1][..4], &[4.0, 5.0, 6.0, 7.0]);
        assert_eq!(&v[1][4..8], &[12.0, 13.0, 14.0, 15.0]);
        assert_eq!(&v[1][16..20], &[4.0, 5.0, 6.0, 7.0]);
        // Patch 2 (bottom left) starts at pixel 32; green (channel 1) is zero.
        assert_eq!(v[2][0], 32.0);
        assert_eq!(v[2][32], 0.0);
    }

    #[test]
    fn bad_configs_name_their_key() {
        let e = Preprocessor::from_json_str(r#"{"patch_size": 4}"#, "p.json").unwrap_err();
        assert!(e.to_string().contains("temporal_patch_size"), "{e}");
        let e = Preprocessor::from_json_str(
            r#"{"patch_size": 4, "temporal_patch_size": 2, "merge_size": 2, "image_std": [1, 1, 1],
                "image_mean": [0, 0], "min_pixels": 1, "max_pixels": 10}"#,
            "p.json",
        )
        .unwrap_err();
        assert!(e.to_string().contains("image_mean"), "{e}");
        let e = Preprocessor::from_json_str(
            r#"{"patch_size": 4, "temporal_patch_size": 2, "merge_size": 2, "do_normalize": false,
                "min_pixels": 1, "max_pixels": 10, "resample": 2}"#,
            "p.json",
        )
        .unwrap_err();
        assert!(e.to_string().contains("resample"), "{e}");
    }
}
