//! Byte sizes as the command line takes them (`--gpu-memory 24GiB`, `--disk-bytes 256MiB`).

use crate::{Error, Result};

/// Parses a byte size: `24GiB`, `512 MiB`, `1.5GB`, `1000`, `1000B`.
///
/// `KiB`, `MiB`, `GiB`, `TiB` are binary (2^10...2^40); `KB`, `MB`, `GB`, `TB` are decimal
/// (10^3...10^12); no unit or `B` means bytes. Units ignore case. Fractions are allowed with a
/// unit and rounded to the nearest byte. A bare `K`/`M`/`G`/`T` is rejected as ambiguous.
pub fn parse_size(text: &str) -> Result<u64> {
    let fail = |why: String| {
        Err(Error::BadSize {
            input: text.to_string(),
            why,
        })
    };
    let trimmed = text.trim();
    let split = trimmed
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(trimmed.len());
    let (number, unit) = (&trimmed[..split], trimmed[split..].trim());
    if number.is_empty() {
        return if trimmed.starts_with('-') {
            fail("a size cannot be negative".into())
        } else {
            fail("expected a number, optionally followed by a unit".into())
        };
    }
    let multiplier: u64 = match unit.to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "kib" => 1 << 10,
        "mib" => 1 << 20,
        "gib" => 1 << 30,
        "tib" => 1 << 40,
        "kb" => 1_000,
        "mb" => 1_000_000,
        "gb" => 1_000_000_000,
        "tb" => 1_000_000_000_000,
        "k" | "m" | "g" | "t" => {
            return fail(format!(
                "unit `{unit}` is ambiguous: write {u}iB for binary or {u}B for decimal",
                u = unit.to_ascii_uppercase()
            ))
        }
        _ => {
            return fail(format!(
                "unknown unit `{unit}`; use B, KiB, MiB, GiB, TiB, KB, MB, GB or TB"
            ))
        }
    };
    if !number.contains('.') {
        let Ok(value) = number.parse::<u64>() else {
            return fail("the number is too large".into());
        };
        return match value.checked_mul(multiplier) {
            Some(bytes) => Ok(bytes),
            None => fail("the size does not fit in 64 bits".into()),
        };
    }
    if multiplier == 1 {
        return fail("a byte count must be a whole number".into());
    }
    let Ok(value) = number.parse::<f64>() else {
        return fail(format!("`{number}` is not a number"));
    };
    let bytes = (value * multiplier as f64).round();
    if bytes >= u64::MAX as f64 {
        return fail("the size does not fit in 64 bits".into());
    }
    Ok(bytes as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse() {
        let cases: &[(&str, u64)] = &[
            ("1000", 1000),
            ("1000B", 1000),
            ("0", 0),
            ("24GiB", 24 << 30),
            ("24 GiB", 24 << 30),
            ("24gib", 24 << 30),
            ("512MiB", 512 << 20),
            ("4KiB", 4096),
            ("1TiB", 1 << 40),
            ("1.5GB", 1_500_000_000),
            ("1.5GiB", 3 << 29),
            ("80GB", 80_000_000_000),
            ("2KB", 2000),
            (" 7 MB ", 7_000_000),
            ("0.5KiB", 512),
            ("16384TiB", 16384 << 40),
        ];
        for (text, bytes) in cases {
            assert_eq!(parse_size(text).unwrap(), *bytes, "{text}");
        }
    }

    #[test]
    fn size_errors_say_what_is_wrong() {
        let cases: &[(&str, &str)] = &[
            ("", "expected a number"),
            ("GiB", "expected a number"),
            ("-5GB", "cannot be negative"),
            ("24G", "ambiguous: write GiB for binary or GB for decimal"),
            ("24 gigs", "unknown unit `gigs`"),
            ("1.5", "whole number"),
            ("1.2.3GB", "not a number"),
            ("99999999999999999999", "too large"),
            ("20000000TB", "does not fit"),
            ("20000000TiB", "does not fit"),
            ("1e9", "unknown unit `e9`"),
        ];
        for (text, expect) in cases {
            let err = parse_size(text).unwrap_err().to_string();
            assert!(
                err.contains(expect),
                "{text:?}: `{err}` should mention `{expect}`"
            );
            assert!(err.contains(&format!("`{text}`")), "{err}");
        }
    }
}
