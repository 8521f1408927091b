//! `protrain models`: the preset list.

use protrain::ir::format_count;
use protrain::models::presets;
use protrain::Result;

/// Arguments of `protrain models`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Print one JSON array instead of a table.
    #[arg(long)]
    json: bool,
}

/// Prints every preset with its family, parameter count and description.
pub fn run(args: Args) -> Result<()> {
    let mut rows = Vec::new();
    for preset in presets() {
        let info = preset.config()?.info()?;
        rows.push((preset, info));
    }
    if args.json {
        let list: Vec<serde_json::Value> = rows
            .iter()
            .map(|(preset, info)| {
                serde_json::json!({
                    "name": preset.name,
                    "model_type": info.model_type,
                    "parameters": info.parameters,
                    "description": preset.description,
                })
            })
            .collect();
        outln!(
            "{}",
            serde_json::to_string_pretty(&list).expect("json values serialise")
        );
        return Ok(());
    }
    outln!(
        "{:<14} {:<8} {:>16}  DESCRIPTION",
        "NAME",
        "TYPE",
        "PARAMETERS"
    );
    for (preset, info) in rows {
        outln!(
            "{:<14} {:<8} {:>16}  {}",
            preset.name,
            info.model_type,
            format_count(info.parameters),
            preset.description
        );
    }
    Ok(())
}
