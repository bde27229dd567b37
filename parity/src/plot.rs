//! SVG charts of the reports, drawn with `plotters`: error per layer, and along the positions of the run.

use crate::report::CompareReport;
use anyhow::{Result, anyhow};
use plotters::prelude::*;
use std::path::Path;

/// The smallest error drawn: exact zeros sit on this floor of the log axis.
const FLOOR: f64 = 1e-12;

const PALETTE: [RGBColor; 6] = [
    RGBColor(31, 119, 180),
    RGBColor(214, 39, 40),
    RGBColor(44, 160, 44),
    RGBColor(148, 103, 189),
    RGBColor(255, 127, 14),
    RGBColor(23, 190, 207),
];

/// A series: a name and its points.
pub struct Series {
    /// The legend.
    pub name: String,
    /// `(x, y)` points, `y` an error (drawn on a log axis).
    pub points: Vec<(f64, f64)>,
}

/// One panel: a title, axis labels, the series and an optional horizontal threshold line.
pub struct Panel {
    /// The caption.
    pub title: String,
    /// The x axis.
    pub x_label: String,
    /// The y axis.
    pub y_label: String,
    /// The series.
    pub series: Vec<Series>,
    /// A threshold drawn as a dashed line.
    pub threshold: Option<f64>,
    /// A vertical marker: its x and its legend (e.g. the end of the prompt).
    pub marker: Option<(f64, String)>,
}

/// Draws panels side by side into an SVG file (written whole or not at all).
pub fn draw(path: &Path, panels: &[Panel]) -> Result<()> {
    let mut svg = String::new();
    draw_into(&mut svg, path, panels)?;
    crate::report::write(path, &svg)
}

/// Draws panels side by side into `svg` (`path` names the chart in errors).
fn draw_into(svg: &mut String, path: &Path, panels: &[Panel]) -> Result<()> {
    let width = 560 * panels.len().max(1) as u32;
    let root = SVGBackend::with_string(svg, (width, 420)).into_drawing_area();
    let err = |e: &dyn std::fmt::Display| anyhow!("drawing {}: {e}", path.display());
    root.fill(&WHITE).map_err(|e| err(&e))?;
    let areas = root.split_evenly((1, panels.len().max(1)));
    for (panel, area) in panels.iter().zip(&areas) {
        let points = panel.series.iter().flat_map(|s| &s.points);
        let x_max = points.clone().map(|p| p.0).fold(1.0, f64::max);
        let y_of = |y: f64| if y.is_finite() { y.max(FLOOR) } else { 1.0 };
        let mut y_min = points.clone().map(|p| y_of(p.1)).fold(1.0, f64::min);
        let mut y_max = points.map(|p| y_of(p.1)).fold(FLOOR, f64::max);
        if let Some(t) = panel.threshold {
            y_min = y_min.min(t);
            y_max = y_max.max(t);
        }
        let (y_lo, y_hi) = (y_min / 3.0, y_max * 3.0);
        let mut chart = ChartBuilder::on(area)
            .caption(&panel.title, ("sans-serif", 16))
            .margin(12)
            .x_label_area_size(36)
            .y_label_area_size(64)
            .build_cartesian_2d(0f64..x_max, (y_lo..y_hi).log_scale())
            .map_err(|e| err(&e))?;
        let ticks = (x_max as usize + 1).min(12);
        chart
            .configure_mesh()
            .x_labels(ticks)
            .x_label_formatter(&|x| {
                if x.fract() == 0.0 {
                    format!("{x:.0}")
                } else {
                    String::new()
                }
            })
            .x_desc(panel.x_label.as_str())
            .y_desc(panel.y_label.as_str())
            .y_label_formatter(&|y| format!("{y:.0e}"))
            .draw()
            .map_err(|e| err(&e))?;
        for (i, s) in panel.series.iter().enumerate() {
            let color = PALETTE[i % PALETTE.len()];
            let pts: Vec<(f64, f64)> = s.points.iter().map(|&(x, y)| (x, y_of(y))).collect();
            chart
                .draw_series(LineSeries::new(pts.clone(), color.stroke_width(2)))
                .map_err(|e| err(&e))?
                .label(s.name.as_str())
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 16, y)], color));
            chart
                .draw_series(pts.iter().map(|&p| Circle::new(p, 3, color.filled())))
                .map_err(|e| err(&e))?;
        }
        if let Some(t) = panel.threshold {
            chart
                .draw_series(DashedLineSeries::new(
                    vec![(0.0, t), (x_max, t)],
                    6,
                    4,
                    BLACK.stroke_width(1),
                ))
                .map_err(|e| err(&e))?
                .label("threshold")
                .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 16, y)], BLACK));
        }
        if let Some((x, label)) = &panel.marker {
            let x = *x;
            chart
                .draw_series(DashedLineSeries::new(
                    vec![(x, y_lo), (x, y_hi)],
                    3,
                    3,
                    RGBColor(120, 120, 120).stroke_width(1),
                ))
                .map_err(|e| err(&e))?
                .label(label.as_str())
                .legend(|(x, y)| {
                    PathElement::new(vec![(x, y), (x + 16, y)], RGBColor(120, 120, 120))
                });
        }
        chart
            .configure_series_labels()
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .position(SeriesLabelPosition::UpperLeft)
            .draw()
            .map_err(|e| err(&e))?;
    }
    root.present().map_err(|e| err(&e))?;
    Ok(())
}

/// The compare-devices chart: every device's output NRMSE per layer, and the first device's NRMSE along the first
/// prompt's positions, one line per layer.
pub fn compare_chart(report: &CompareReport, path: &Path) -> Result<()> {
    let per_layer = Panel {
        title: "Layer output error (worst prompt)".into(),
        x_label: "layer".into(),
        y_label: "NRMSE".into(),
        series: report
            .devices
            .iter()
            .map(|d| Series {
                name: format!(
                    "{} ({})",
                    d.device,
                    d.record
                        .precision
                        .as_ref()
                        .map_or("?".to_string(), |p| p.to_string())
                ),
                points: d
                    .layers
                    .iter()
                    .map(|l| (l.layer as f64, l.output.nrmse.get()))
                    .collect(),
            })
            .collect(),
        threshold: report.devices.first().map(|d| d.thresholds.max_layer_nrmse),
        marker: None,
    };
    let mut panels = vec![per_layer];
    if let Some(d) = report.devices.first()
        && let Some(p) = d.prompts.first()
    {
        panels.push(Panel {
            title: format!("{}: error along prompt `{}`", d.device, p.label),
            x_label: "position".into(),
            y_label: "NRMSE".into(),
            series: p
                .layers
                .iter()
                .map(|l| Series {
                    name: format!("layer {}", l.layer),
                    points: l
                        .nrmse_by_position
                        .iter()
                        .enumerate()
                        .map(|(i, &e)| (i as f64, e))
                        .collect(),
                })
                .collect(),
            threshold: Some(d.thresholds.max_layer_nrmse),
            marker: Some((p.prompt_tokens as f64 - 0.5, "end of prompt".into())),
        });
    }
    draw(path, &panels)
}
