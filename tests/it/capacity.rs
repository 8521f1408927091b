//! Capacity: on an rtx3090 with 256 GiB of host memory, batch 1 x seq 1024, bf16,
//! the deepest LLaMA-13B-width model (hidden 5120, 40 heads, intermediate 13824, vocab 32000)
//! that compiles, found by bisection over the layer count, is at least 95% of the capacity
//! bound at 12 bytes per parameter:
//!
//! ```text
//! bound = (usable device bytes + host bytes - overhead) / 12
//! overhead = the winner's device activations + chunk buffers + workspaces + inputs
//!          + its host staging buffers (the 12-byte layout's four chunks)
//! ```
//!
//! 12 bytes is the f32 master weight and Adam's two moments, what no layout can drop; a chunk
//! kept on the device costs 16 there (its bf16 parameters and gradients too), which the 5%
//! covers. `compile`'s defaults (no gradient clipping, bf16 on a GPU) let the search stage
//! chunks: the winner takes the 12-byte layout (`host_layout=12` or `12xN`). Before the
//! 14-byte layout and the host trade, 56 layers (18.1B parameters) compiled; with the 14-byte
//! layout, 64 (20.6B, 84.5% of this bound).

use protrain::ir::{BufferKind, HardwareProfile, HostLayout, Schedule};
use protrain::{CompileOptions, PolicyChoice};

const GIB: u64 = 1 << 30;

fn options() -> CompileOptions {
    let mut hardware = HardwareProfile::preset("rtx3090").unwrap();
    hardware.host_memory_bytes = 256 * GIB;
    CompileOptions {
        batch: 1,
        seq: 1024,
        policy: PolicyChoice::Auto,
        ..CompileOptions::for_hardware(hardware)
    }
}

/// The LLaMA-13B-width schedule at `layers` layers, or `None` when nothing fits.
fn compile(layers: u64) -> Option<Schedule> {
    let mut config = protrain::models::load("llama-2-13b").unwrap();
    config.num_layers = layers;
    match protrain::compile(&config, &options()) {
        Ok(c) => Some((*c.schedule).clone()),
        Err(e) => {
            let text = e.to_string();
            assert!(
                text.contains("no policy fits"),
                "{layers} layers fail otherwise: {text}"
            );
            None
        }
    }
}

#[test]
fn the_deepest_llama_13b_width_model_that_compiles_is_near_the_12_byte_bound() {
    let options = options();
    assert_eq!(
        options.optimizer.grad_clip, None,
        "compile's default clips nothing"
    );
    // 64 layers fit at 14 bytes per parameter; 76 (24.4B parameters) need more than the
    // memory holds at 12.
    let (mut fits, mut refused) = (64u64, 76u64);
    let mut best = compile(fits).expect("64 layers fit");
    assert!(compile(refused).is_none(), "{refused} layers compile");
    while refused - fits > 1 {
        let mid = (fits + refused) / 2;
        match compile(mid) {
            Some(s) => (fits, best) = (mid, s),
            None => refused = mid,
        }
    }
    let m = best.header.prediction.memory;
    let staging: u64 = best
        .buffers
        .iter()
        .filter(|b| {
            matches!(
                b.kind,
                BufferKind::ParamStaging { .. } | BufferKind::GradStaging { .. }
            )
        })
        .map(|b| b.size)
        .sum();
    let overhead = m.activations + m.chunk_buffers + m.workspace + m.inputs + staging;
    let memory = options.hardware.usable_device_bytes() + options.hardware.host_memory_bytes;
    let bound = (memory - overhead) / 12;
    let params = best.header.param_count;
    let fraction = params as f64 / bound as f64;
    eprintln!(
        "largest: {fits} layers, {params} parameters, policy {}; bound {bound} ({:.1}%); host \
         {} of {}, device {}; staged chunks {} of {}",
        best.header.policy,
        100.0 * fraction,
        best.host_bytes,
        options.hardware.host_memory_bytes,
        best.arena_bytes,
        best.staged_chunks().len(),
        best.chunks.len()
    );
    assert!(
        matches!(best.header.policy.host_layout, HostLayout::Staged { .. }),
        "the winner stages chunks: {}",
        best.header.policy
    );
    assert!(
        fraction >= 0.95,
        "{fits} layers ({params} parameters) is {:.1}% of the 12-byte bound {bound}",
        100.0 * fraction
    );
    protrain::ir::verify_schedule::verify(best).expect("the winner verifies");
}

/// MegaTrain's setting (arXiv 2604.05091): a 120B-parameter LLaMA-shaped model (llama-2-70b's
/// width, 140 layers) compiles for one h200 with 1536 GiB of host memory and verifies.
#[test]
fn megatrains_120b_model_compiles_for_one_h200() {
    let mut config = protrain::models::load("llama-2-70b").unwrap();
    config.num_layers = 140;
    let mut hardware = HardwareProfile::preset("h200").unwrap();
    hardware.host_memory_bytes = 1536 * GIB;
    let options = CompileOptions::for_hardware(hardware);
    let compiled = protrain::compile(&config, &options).expect("MegaTrain's setting compiles");
    let s = (*compiled.schedule).clone();
    eprintln!(
        "megatrain: {} parameters, policy {}, host {} of {}, device {}, staged chunks {} of {}",
        s.header.param_count,
        s.header.policy,
        s.host_bytes,
        options.hardware.host_memory_bytes,
        s.arena_bytes,
        s.staged_chunks().len(),
        s.chunks.len()
    );
    assert!(s.header.param_count > 115_000_000_000);
    assert!(s.host_bytes <= 1536 * GIB);
    protrain::ir::verify_schedule::verify(s).expect("it verifies");
}
