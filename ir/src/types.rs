//! Tensor types: element types, shapes, and byte sizes.

use serde::{Deserialize, Serialize};
use std::fmt;

/// An element type.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DType {
    /// IEEE single precision.
    F32,
    /// bfloat16.
    BF16,
    /// IEEE half precision.
    F16,
    /// 32-bit signed integer (token ids).
    I32,
}

impl DType {
    /// Bytes per element.
    pub fn size(self) -> u64 {
        match self {
            DType::F32 | DType::I32 => 4,
            DType::BF16 | DType::F16 => 2,
        }
    }

    /// The printed name: `f32`, `bf16`, `f16`, `i32`.
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::BF16 => "bf16",
            DType::F16 => "f16",
            DType::I32 => "i32",
        }
    }

    /// Whether this is a floating-point type.
    pub fn is_float(self) -> bool {
        !matches!(self, DType::I32)
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The type of a tensor value: its shape and element type. A scalar has an empty shape.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct TensorType {
    /// Dimensions, outermost first.
    pub shape: Vec<u64>,
    /// Element type.
    pub dtype: DType,
}

impl TensorType {
    /// A tensor type of the given shape and element type.
    pub fn new(shape: impl Into<Vec<u64>>, dtype: DType) -> Self {
        Self {
            shape: shape.into(),
            dtype,
        }
    }

    /// Number of elements.
    pub fn numel(&self) -> u64 {
        self.shape.iter().product()
    }

    /// Size in bytes.
    pub fn bytes(&self) -> u64 {
        self.numel() * self.dtype.size()
    }

    /// The innermost dimension (1 for a scalar).
    pub fn last_dim(&self) -> u64 {
        self.shape.last().copied().unwrap_or(1)
    }

    /// The product of every dimension but the innermost ("rows").
    pub fn rows(&self) -> u64 {
        match self.shape.split_last() {
            Some((_, outer)) => outer.iter().product(),
            None => 1,
        }
    }

    /// The same shape with another innermost dimension.
    pub fn with_last_dim(&self, last: u64) -> Self {
        let mut shape = self.shape.clone();
        match shape.last_mut() {
            Some(d) => *d = last,
            None => shape.push(last),
        }
        Self::new(shape, self.dtype)
    }
}

impl fmt::Display for TensorType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}[", self.dtype)?;
        for (i, d) in self.shape.iter().enumerate() {
            if i > 0 {
                f.write_str(",")?;
            }
            write!(f, "{d}")?;
        }
        f.write_str("]")
    }
}

/// Formats a byte count for people: `512 B`, `24.0 MiB`, `13.50 GiB`.
pub fn format_bytes(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["KiB", "MiB", "GiB", "TiB", "PiB"];
    if bytes < 1024 {
        return format!("{bytes} B");
    }
    let mut value = bytes as f64 / 1024.0;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    if value < 100.0 && unit >= 2 {
        format!("{value:.2} {}", UNITS[unit])
    } else {
        format!("{value:.1} {}", UNITS[unit])
    }
}

/// Formats a count for people with thousands separators: `6,738,415,616`.
pub fn format_count(n: u64) -> String {
    let digits = n.to_string();
    let mut out = String::with_capacity(digits.len() + digits.len() / 3);
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_formatting_picks_the_unit() {
        assert_eq!(format_bytes(512), "512 B");
        assert_eq!(format_bytes(24 * 1024 * 1024), "24.0 MiB");
        assert_eq!(format_bytes(3 * 1024 * 1024 * 1024 / 2), "1.50 GiB");
        assert_eq!(format_bytes(1536), "1.5 KiB");
    }

    #[test]
    fn count_formatting_groups_thousands() {
        assert_eq!(format_count(0), "0");
        assert_eq!(format_count(999), "999");
        assert_eq!(format_count(1000), "1,000");
        assert_eq!(format_count(6738415616), "6,738,415,616");
    }

    #[test]
    fn tensor_type_sizes_and_display() {
        let t = TensorType::new([8, 1024, 768], DType::F32);
        assert_eq!(t.numel(), 8 * 1024 * 768);
        assert_eq!(t.bytes(), 8 * 1024 * 768 * 4);
        assert_eq!(t.rows(), 8 * 1024);
        assert_eq!(t.to_string(), "f32[8,1024,768]");
        assert_eq!(TensorType::new([], DType::F32).to_string(), "f32[]");
        assert_eq!(TensorType::new([], DType::F32).numel(), 1);
    }
}
