//! `protrain plot`: a picture of a schedule's device memory over one predicted step.
//!
//! The top chart stacks the bytes in use by kind ([`MemoryKind::DEVICE`]) over the simulated
//! step, with the device budget, the planned arena and the peak marked; the bottom chart is
//! the arena as planned, each device buffer a rectangle over offset and time, as PyTorch's
//! memory visualiser draws a recorded run. Times are the simulator's, the timeline `trace`
//! writes. Drawing is plotters'; text is laid out with a font compiled into the binary, so
//! neither building nor running needs a system font.

use plotters::coord::types::RangedCoordf64;
use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};
use protrain::compiler::simulate::{buffer_lives, BufferLife, MemoryKind, MemoryTimeline};
use protrain::ir::{format_bytes, Schedule};
use protrain::{Error, Result};
use std::path::{Path, PathBuf};

/// Arguments of `protrain plot`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// A schedule written by `protrain compile`.
    schedule: PathBuf,
    /// The picture to write: FILE.svg or FILE.png (the extension decides), or `-` for SVG on
    /// standard output.
    #[arg(short, long, value_name = "FILE")]
    output: PathBuf,
    /// The hardware to predict times for [default: the one the schedule was compiled for].
    #[arg(long)]
    hardware: Option<String>,
    /// Print what was drawn (peak, budget, arena, buffers) as one JSON object instead of text.
    #[arg(long)]
    json: bool,
}

/// Width and height of the picture in pixels.
const SIZE: (u32, u32) = (1200, 900);

/// The opacity of the arena's buffer rectangles: below 1 so that a buffer drawn over a
/// neighbour's edge shows it, and a mark that tells them from the legend's swatches in an SVG.
pub const BUFFER_OPACITY: f64 = 0.9;

/// Pixels kept right of both charts for the legend, so that it hides no data.
const LEGEND_WIDTH: u32 = 210;

/// Columns the stacked chart is drawn in at most: a step with more changes of memory is
/// shown per column at its highest point, so the peak stays visible and the file small.
const COLUMNS: usize = 1000;

/// The picture formats `plot` writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Format {
    Svg,
    Png,
}

impl Format {
    /// The format `output` names by its extension; `-` is SVG on standard output.
    fn of(output: &Path) -> Result<Self> {
        if output == Path::new("-") {
            return Ok(Format::Svg);
        }
        match output
            .extension()
            .and_then(|e| e.to_str())
            .map(str::to_ascii_lowercase)
            .as_deref()
        {
            Some("svg") => Ok(Format::Svg),
            Some("png") => Ok(Format::Png),
            _ => Err(Error::Usage(format!(
                "cannot tell which picture to write from '{}': name the output FILE.svg or \
                 FILE.png, or `-` for SVG on standard output",
                output.display()
            ))),
        }
    }

    fn name(self) -> &'static str {
        match self {
            Format::Svg => "svg",
            Format::Png => "png",
        }
    }
}

/// What the picture shows, computed before any drawing.
struct Picture {
    title: String,
    /// The predicted step time.
    step_seconds: f64,
    /// Where the timeline ends: the step less what the host backend's shared cores add to
    /// it, which no span shows. The charts span this.
    timeline_seconds: f64,
    budget: u64,
    arena: u64,
    /// Device buffers of nonzero size with their lives, offsets and sizes.
    buffers: Vec<(BufferLife, u64, u64)>,
    timeline: MemoryTimeline,
    peak: (u64, f64),
}

/// `protrain plot`: simulates the schedule and draws its memory.
pub fn run(args: Args) -> Result<()> {
    let format = Format::of(&args.output)?;
    let mut inputs = super::paths::Inputs::new();
    inputs
        .file(&args.schedule)
        .hardware(args.hardware.as_deref());
    let to_stdout = super::paths::stdout_or_checked(&args.output, args.json, "picture", &inputs)?;
    let s = super::schedule::read(&args.schedule)?;
    let (sim, on) = super::schedule::simulated(&s, args.hardware.as_deref())?;
    let picture = picture(&s, &sim.timeline, sim.step_seconds, &on);
    let bytes = match format {
        Format::Svg => svg(&picture)?.into_bytes(),
        Format::Png => png(&picture)?,
    };
    if to_stdout {
        crate::out::write_all(&bytes);
        return Ok(());
    }
    protrain::ir::output::write_atomic_checked(&args.output, &[&args.schedule], |w| {
        w.write_all(&bytes)
    })
    .map_err(|source| Error::Write {
        path: args.output.clone(),
        source,
    })?;
    let (peak, at) = picture.peak;
    if args.json {
        let at_peak = peak_by_kind(&picture.timeline);
        let v = serde_json::json!({
            "output": args.output,
            "format": format.name(),
            "width": SIZE.0,
            "height": SIZE.1,
            "hardware": on,
            "step_s": picture.step_seconds,
            "peak_bytes": peak,
            "peak_at_s": at,
            "budget_bytes": picture.budget,
            "arena_bytes": picture.arena,
            "buffers": picture.buffers.len(),
            "at_peak": at_peak
                .iter()
                .map(|(k, b)| (k.name().to_string(), serde_json::json!(b)))
                .collect::<serde_json::Map<_, _>>(),
        });
        outln!(
            "{}",
            serde_json::to_string_pretty(&v).expect("JSON values serialise")
        );
    } else {
        outln!(
            "wrote {}: device memory peaks at {} at {:.3} ms of a {:.3} ms step on {on} \
             (arena {}, budget {}), {} buffers",
            args.output.display(),
            format_bytes(peak),
            at * 1e3,
            picture.step_seconds * 1e3,
            format_bytes(picture.arena),
            format_bytes(picture.budget),
            picture.buffers.len()
        );
    }
    Ok(())
}

/// The bytes of each kind in use at the peak, kinds that hold none left out.
fn peak_by_kind(timeline: &MemoryTimeline) -> Vec<(MemoryKind, u64)> {
    let (_, at) = timeline.peak();
    let Some((_, bytes)) = timeline.points.iter().find(|(t, _)| *t == at) else {
        return Vec::new();
    };
    timeline
        .kinds
        .iter()
        .zip(bytes)
        .filter(|(_, &b)| b > 0)
        .map(|(&k, &b)| (k, b))
        .collect()
}

/// What to draw of schedule `s`, whose simulation on `on` gave `spans` and a step of `step`
/// seconds.
fn picture(
    s: &Schedule,
    spans: &[protrain::compiler::simulate::Span],
    step: f64,
    on: &str,
) -> Picture {
    let lives = buffer_lives(s, spans);
    let timeline = MemoryTimeline::new(s, &lives, &MemoryKind::DEVICE);
    let peak = timeline.peak();
    let buffers = lives
        .iter()
        .filter(|l| l.kind.on_device())
        .map(|l| {
            let b = &s.buffers[l.buffer.index()];
            (*l, b.offset, b.size)
        })
        .filter(|&(_, _, size)| size > 0)
        .collect();
    let h = &s.header;
    Picture {
        title: format!(
            "{} (batch {} x seq {}, {}) on {on}: device memory over one step",
            h.model, h.batch, h.seq, h.dtype
        ),
        step_seconds: step,
        timeline_seconds: spans
            .iter()
            .map(|sp| sp.end)
            .fold(0.0, f64::max)
            .max(f64::MIN_POSITIVE),
        budget: h.device_budget_bytes,
        arena: s.arena_bytes,
        buffers,
        timeline,
        peak,
    }
}

/// The picture as SVG text.
fn svg(p: &Picture) -> Result<String> {
    let mut text = String::new();
    {
        let root = SVGBackend::with_string(&mut text, SIZE).into_drawing_area();
        draw(&root, p).map_err(drawing_error)?;
        root.present().map_err(drawing_error)?;
    }
    Ok(text)
}

/// The picture as PNG bytes.
fn png(p: &Picture) -> Result<Vec<u8>> {
    let mut rgb = vec![0u8; (SIZE.0 * SIZE.1 * 3) as usize];
    {
        let root = BitMapBackend::with_buffer(&mut rgb, SIZE).into_drawing_area();
        draw(&root, p).map_err(drawing_error)?;
        root.present().map_err(drawing_error)?;
    }
    let mut out = Vec::new();
    let mut encoder = ::png::Encoder::new(&mut out, SIZE.0, SIZE.1);
    encoder.set_color(::png::ColorType::Rgb);
    encoder.set_depth(::png::BitDepth::Eight);
    encoder
        .write_header()
        .and_then(|mut w| w.write_image_data(&rgb))
        .map_err(|e| Error::Usage(format!("cannot encode the PNG: {e}")))?;
    Ok(out)
}

fn drawing_error<E: std::error::Error + Send + Sync>(e: DrawingAreaErrorKind<E>) -> Error {
    Error::Usage(format!("cannot draw the picture: {e}"))
}

/// Registers the compiled-in font as plotters' sans-serif, once.
fn register_font() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        // The font is a constant of a dependency: a failure here is a broken build, and then
        // text is left out rather than the picture.
        let _ = plotters::style::register_font(
            "sans-serif",
            FontStyle::Normal,
            epaint_default_fonts::UBUNTU_LIGHT,
        );
    });
}

/// The colour of each device kind (seaborn's "deep" palette, which tells its colours apart
/// for most readers, grey for inputs).
fn colour(kind: MemoryKind) -> RGBColor {
    match kind {
        MemoryKind::Inputs => RGBColor(140, 140, 140),
        MemoryKind::PersistentChunks => RGBColor(76, 114, 176),
        MemoryKind::ChunkBuffers => RGBColor(100, 181, 205),
        MemoryKind::Gradients => RGBColor(221, 132, 82),
        MemoryKind::ActivationsKept => RGBColor(85, 168, 104),
        MemoryKind::ActivationsSwapped => RGBColor(129, 114, 179),
        MemoryKind::ActivationsRecomputed => RGBColor(204, 185, 116),
        MemoryKind::Temporaries => RGBColor(218, 139, 195),
        MemoryKind::Workspaces => RGBColor(147, 120, 96),
        _ => RGBColor(0, 0, 0),
    }
}

/// A slightly darker shade, so that neighbouring buffers of one kind stay apart.
fn shade(c: RGBColor) -> RGBColor {
    let d = |v: u8| (f64::from(v) * 0.82) as u8;
    RGBColor(d(c.0), d(c.1), d(c.2))
}

/// The unit the byte axes are labelled in: the largest binary unit `top` has at least one of.
fn unit(top: u64) -> (f64, &'static str) {
    const UNITS: [(f64, &str); 4] = [
        ((1u64 << 40) as f64, "TiB"),
        ((1u64 << 30) as f64, "GiB"),
        ((1u64 << 20) as f64, "MiB"),
        ((1u64 << 10) as f64, "KiB"),
    ];
    UNITS
        .into_iter()
        .find(|&(u, _)| top as f64 >= u)
        .unwrap_or((1.0, "B"))
}

/// The stacked chart's columns: `(start, end, bytes by kind)`, the step function itself when
/// it has few enough changes, else [`COLUMNS`] equal columns each showing its highest point.
fn columns(t: &MemoryTimeline, step: f64) -> Vec<(f64, f64, Vec<u64>)> {
    let pts = &t.points;
    let end_of = |i: usize| pts.get(i + 1).map_or(step, |p| p.0);
    if pts.len() <= COLUMNS {
        return (0..pts.len())
            .map(|i| (pts[i].0, end_of(i).max(pts[i].0), pts[i].1.clone()))
            .collect();
    }
    let width = step / COLUMNS as f64;
    let total = |i: usize| pts[i].1.iter().sum::<u64>();
    let mut out = Vec::with_capacity(COLUMNS);
    let mut i = 0;
    for c in 0..COLUMNS {
        let (a, b) = (c as f64 * width, (c + 1) as f64 * width);
        // The point in force at the column's start, then every point starting inside it.
        while i + 1 < pts.len() && pts[i + 1].0 <= a {
            i += 1;
        }
        let mut best = i;
        let mut j = i + 1;
        while j < pts.len() && pts[j].0 < b {
            if total(j) > total(best) {
                best = j;
            }
            j += 1;
        }
        out.push((a, b, pts[best].1.clone()));
    }
    out
}

/// An error of drawing on `DB`.
type DrawResult<DB> =
    std::result::Result<(), DrawingAreaErrorKind<<DB as DrawingBackend>::ErrorType>>;

/// A chart of milliseconds (x) against bytes or offsets in some unit (y).
type Chart<'a, DB> = ChartContext<'a, DB, Cartesian2d<RangedCoordf64, RangedCoordf64>>;

fn draw<DB: DrawingBackend>(root: &DrawingArea<DB, Shift>, p: &Picture) -> DrawResult<DB> {
    register_font();
    root.fill(&WHITE)?;
    let root = root.titled(&p.title, ("sans-serif", 20))?;
    let (top, bottom) = root.split_vertically(SIZE.1 * 45 / 100);
    draw_memory(&top, p)?;
    draw_arena(&bottom, p)
}

/// The top chart: memory over time, stacked by kind, with the arena, the budget and the
/// peak marked, and the legend of the kinds drawn.
fn draw_memory<DB: DrawingBackend>(top: &DrawingArea<DB, Shift>, p: &Picture) -> DrawResult<DB> {
    let ms = p.timeline_seconds * 1e3;
    let (peak, _) = p.peak;
    let high = peak.max(p.arena).max(1);
    // The budget is drawn where it is within reach of the memory used; far above, it is
    // named at the top instead of squashing the memory into a sliver.
    let budget_shown = p.budget <= high.saturating_mul(2);
    let top_bytes = if budget_shown {
        high.max(p.budget)
    } else {
        high
    };
    let (u, uname) = unit(top_bytes);
    let y_max = top_bytes as f64 / u * 1.12;
    let mut chart = ChartBuilder::on(top)
        .margin(12)
        .margin_right(LEGEND_WIDTH)
        .x_label_area_size(36)
        .y_label_area_size(70)
        .caption("memory in use, by kind", ("sans-serif", 16))
        .build_cartesian_2d(0.0..ms, 0.0..y_max)?;
    chart
        .configure_mesh()
        .x_desc("time in the step (ms)")
        .y_desc(uname)
        .label_style(("sans-serif", 13))
        .axis_desc_style(("sans-serif", 14))
        .light_line_style(WHITE.mix(0.0))
        .draw()?;
    let cols = columns(&p.timeline, p.timeline_seconds);
    let kinds = &p.timeline.kinds;
    for (k, &kind) in kinds.iter().enumerate() {
        if cols.iter().all(|c| c.2[k] == 0) {
            continue;
        }
        let below = |c: &(f64, f64, Vec<u64>)| c.2[..k].iter().sum::<u64>() as f64 / u;
        let above = |c: &(f64, f64, Vec<u64>)| c.2[..=k].iter().sum::<u64>() as f64 / u;
        let mut outline: Vec<(f64, f64)> = Vec::with_capacity(cols.len() * 4);
        for c in &cols {
            outline.push((c.0 * 1e3, above(c)));
            outline.push((c.1 * 1e3, above(c)));
        }
        for c in cols.iter().rev() {
            outline.push((c.1 * 1e3, below(c)));
            outline.push((c.0 * 1e3, below(c)));
        }
        let fill = colour(kind);
        chart.draw_series(std::iter::once(Polygon::new(outline, fill.filled())))?;
    }
    draw_marks(&mut chart, p, u, y_max, budget_shown)?;
    let shown = kinds
        .iter()
        .enumerate()
        .filter(|&(k, _)| cols.iter().any(|c| c.2[k] > 0))
        .map(|(_, &kind)| kind);
    draw_legend(top, shown)
}

/// The memory chart's marks (its y axis in units of `u` bytes, up to `y_max`): the planned
/// arena, the budget (at its height when `budget_shown`, else named at the top), and the
/// peak with its label on the side with more room.
fn draw_marks<DB: DrawingBackend>(
    chart: &mut Chart<'_, DB>,
    p: &Picture,
    u: f64,
    y_max: f64,
    budget_shown: bool,
) -> DrawResult<DB> {
    let ms = p.timeline_seconds * 1e3;
    let (peak, peak_at) = p.peak;
    let hline = |bytes: u64| vec![(0.0, bytes as f64 / u), (ms, bytes as f64 / u)];
    chart.draw_series(std::iter::once(PathElement::new(
        hline(p.arena),
        BLACK.mix(0.6).stroke_width(1),
    )))?;
    chart.draw_series(std::iter::once(Text::new(
        format!("arena {} (planned)", format_bytes(p.arena)),
        (ms * 0.99, p.arena as f64 / u),
        ("sans-serif", 13)
            .into_font()
            .color(&BLACK.mix(0.8))
            .pos(Pos::new(HPos::Right, VPos::Top)),
    )))?;
    let budget_label = format!("budget {}", format_bytes(p.budget));
    if budget_shown {
        chart.draw_series(std::iter::once(PathElement::new(
            hline(p.budget),
            RED.stroke_width(2),
        )))?;
        chart.draw_series(std::iter::once(Text::new(
            budget_label,
            (ms * 0.99, p.budget as f64 / u),
            ("sans-serif", 14)
                .into_font()
                .color(&RED)
                .pos(Pos::new(HPos::Right, VPos::Bottom)),
        )))?;
    } else {
        chart.draw_series(std::iter::once(Text::new(
            format!("{budget_label} (above the chart)"),
            (ms * 0.99, y_max * 0.98),
            ("sans-serif", 14)
                .into_font()
                .color(&RED)
                .pos(Pos::new(HPos::Right, VPos::Top)),
        )))?;
    }
    let peak_point = (peak_at * 1e3, peak as f64 / u);
    chart.draw_series(std::iter::once(Circle::new(
        peak_point,
        5,
        BLACK.stroke_width(2),
    )))?;
    // The peak's label sits on the side of the point with more room.
    let left = peak_at < p.timeline_seconds / 2.0;
    chart.draw_series(std::iter::once(Text::new(
        format!("peak {} at {:.3} ms", format_bytes(peak), peak_at * 1e3),
        peak_point,
        ("sans-serif", 14).into_font().color(&BLACK).pos(Pos::new(
            if left { HPos::Left } else { HPos::Right },
            VPos::Bottom,
        )),
    )))?;
    Ok(())
}

/// The legend of the memory kinds `shown`, in the margin kept right of the charts.
fn draw_legend<DB: DrawingBackend>(
    top: &DrawingArea<DB, Shift>,
    shown: impl Iterator<Item = MemoryKind>,
) -> DrawResult<DB> {
    let x0 = (SIZE.0 - LEGEND_WIDTH + 8) as i32;
    for (row, kind) in shown.enumerate() {
        let y = 60 + 22 * row as i32;
        top.draw(&Rectangle::new(
            [(x0, y), (x0 + 14, y + 14)],
            colour(kind).filled(),
        ))?;
        top.draw(&Text::new(
            kind.name(),
            (x0 + 22, y + 7),
            ("sans-serif", 14)
                .into_font()
                .color(&BLACK)
                .pos(Pos::new(HPos::Left, VPos::Center)),
        ))?;
    }

    Ok(())
}

/// The bottom chart: the arena as planned, each buffer a rectangle over its offset and its
/// life.
fn draw_arena<DB: DrawingBackend>(bottom: &DrawingArea<DB, Shift>, p: &Picture) -> DrawResult<DB> {
    let ms = p.timeline_seconds * 1e3;
    let (au, aname) = unit(p.arena.max(1));
    let a_max = p.arena.max(1) as f64 / au * 1.04;
    let mut arena = ChartBuilder::on(bottom)
        .margin(12)
        .margin_right(LEGEND_WIDTH)
        .x_label_area_size(36)
        .y_label_area_size(70)
        .caption(
            "the arena as planned: each buffer at its offset while it holds data",
            ("sans-serif", 16),
        )
        .build_cartesian_2d(0.0..ms, 0.0..a_max)?;
    arena
        .configure_mesh()
        .x_desc("time in the step (ms)")
        .y_desc(format!("offset ({aname})"))
        .label_style(("sans-serif", 13))
        .axis_desc_style(("sans-serif", 14))
        .light_line_style(WHITE.mix(0.0))
        .draw()?;
    // A life shorter than a pixel still shows as one.
    let pixel = ms / f64::from(SIZE.0);
    arena.draw_series(p.buffers.iter().map(|&(life, offset, size)| {
        let base = colour(life.kind);
        let c = if life.buffer.index() % 2 == 0 {
            base
        } else {
            shade(base)
        };
        let (x0, x1) = (
            life.start * 1e3,
            (life.end * 1e3).max(life.start * 1e3 + pixel),
        );
        Rectangle::new(
            [(x0, offset as f64 / au), (x1, (offset + size) as f64 / au)],
            c.mix(BUFFER_OPACITY).filled(),
        )
    }))?;
    arena.draw_series(std::iter::once(PathElement::new(
        vec![(0.0, p.arena as f64 / au), (ms, p.arena as f64 / au)],
        BLACK.mix(0.6).stroke_width(1),
    )))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_format_follows_the_extension() {
        assert_eq!(Format::of(Path::new("m.svg")).unwrap(), Format::Svg);
        assert_eq!(Format::of(Path::new("m.PNG")).unwrap(), Format::Png);
        assert_eq!(Format::of(Path::new("-")).unwrap(), Format::Svg);
        let err = Format::of(Path::new("m.jpg")).unwrap_err().to_string();
        assert!(err.contains("FILE.svg or FILE.png"), "{err}");
    }

    #[test]
    fn columns_keep_the_peak_of_a_long_timeline() {
        let kinds = vec![MemoryKind::Temporaries];
        let mut points: Vec<(f64, Vec<u64>)> =
            (0..5000).map(|i| (i as f64, vec![i as u64 % 7])).collect();
        points[2345].1 = vec![1000];
        let t = MemoryTimeline { kinds, points };
        let cols = columns(&t, 5000.0);
        assert_eq!(cols.len(), COLUMNS);
        assert_eq!(cols.iter().map(|c| c.2[0]).max(), Some(1000));
        // Few points: the step function itself.
        let short = MemoryTimeline {
            kinds: vec![MemoryKind::Temporaries],
            points: vec![(0.0, vec![1]), (2.0, vec![3])],
        };
        assert_eq!(
            columns(&short, 5.0),
            [(0.0, 2.0, vec![1]), (2.0, 5.0, vec![3])]
        );
    }
}
