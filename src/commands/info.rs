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
        outln!(
            "{}",
            serde_json::to_string_pretty(&info).expect("info serialises")
        );
        return Ok(());
    }
    let states = &info.model_state_bytes;
    outln!("{} ({})", info.name, info.model_type);
    outln!("  layers             {}", info.layers);
    outln!("  hidden size        {}", info.hidden);
    outln!(
        "  heads              {} (KV heads {}, head dim {})",
        info.heads,
        info.kv_heads,
        info.head_dim
    );
    outln!("  intermediate size  {}", info.intermediate);
    outln!("  vocab              {}", info.vocab);
    outln!("  max positions      {}", info.max_positions);
    outln!("  parameters         {}", format_count(info.parameters));
    for line in &info.features {
        outln!("  {line}");
    }
    outln!(
        "  model states       {} (16 bytes per parameter)",
        format_bytes(states.total)
    );
    outln!("    bf16 params      {}", format_bytes(states.params));
    outln!("    bf16 grads       {}", format_bytes(states.grads));
    outln!("    fp32 master      {}", format_bytes(states.master));
    outln!("    fp32 Adam m      {}", format_bytes(states.adam_m));
    outln!("    fp32 Adam v      {}", format_bytes(states.adam_v));
    outln!("  host bytes per offloaded parameter, bf16 training:");
    outln!(
        "    16  {:>10}  fully resident (all of the above)",
        format_bytes(states.total)
    );
    outln!(
        "    14  {:>10}  gradients in the parameter chunk (host_layout=14)",
        format_bytes(states.grads_in_params)
    );
    outln!(
        "    12  {:>10}  staging: master and moments only (host_layout=12; not with --grad-clip or f16)",
        format_bytes(states.staged)
    );
    Ok(())
}
