//! `protrain info`: a model's vital statistics.

use protrain::ir::{format_bytes, format_count};
use protrain::Result;

/// Arguments of `protrain info`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// A preset name, a path to a Hugging Face config.json, or a directory holding one.
    model: String,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    json: bool,
}

/// Prints layers, widths, heads, vocabulary, the exact parameter count and model-state bytes.
pub fn run(args: Args) -> Result<()> {
    let config = protrain::models::load(&args.model)?;
    let info = config.info()?;
    if args.json {
        println!(
            "{}",
            serde_json::to_string_pretty(&info).expect("info serialises")
        );
        return Ok(());
    }
    let states = &info.model_state_bytes;
    println!("{} ({})", info.name, info.model_type);
    println!("  layers             {}", info.layers);
    println!("  hidden size        {}", info.hidden);
    println!(
        "  heads              {} (KV heads {}, head dim {})",
        info.heads, info.kv_heads, info.head_dim
    );
    println!("  intermediate size  {}", info.intermediate);
    println!("  vocab              {}", info.vocab);
    println!("  max positions      {}", info.max_positions);
    println!("  parameters         {}", format_count(info.parameters));
    println!(
        "  model states       {} (16 bytes per parameter)",
        format_bytes(states.total)
    );
    println!("    bf16 params      {}", format_bytes(states.params));
    println!("    bf16 grads       {}", format_bytes(states.grads));
    println!("    fp32 master      {}", format_bytes(states.master));
    println!("    fp32 Adam m      {}", format_bytes(states.adam_m));
    println!("    fp32 Adam v      {}", format_bytes(states.adam_v));
    Ok(())
}
