//! Capacity (issue 18): on an rtx3090 with 256 GiB of host memory, batch 1 x seq 1024, bf16,
//! the deepest LLaMA-13B-width model (hidden 5120, 40 heads, intermediate 13824, vocab 32000)
//! that compiles, found by bisection over the layer count, is within 5% of what the memory can
//! hold at the bytes per parameter protrain's host layouts reach: usable device plus host
//! bytes, less the winner's activations, chunk buffers, workspaces and inputs, over 14 bytes
//! per parameter (the gradients-in-parameters layout; persistent chunks cost 16 on the device,
//! which the 5% covers). Before the 14-byte layout and the search's host trade, 56 layers
//! (18.1B parameters) compiled and 60 were refused, 82% of that bound.
//!
//! The target is 95% of the 12-byte bound (staging: no host copy of the bf16
//! parameters), which needs the staged layout that is not built yet; 14 bytes reach at most
//! 12/14 = 86% of that bound.

use protrain::ir::{HardwareProfile, Schedule};
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
fn the_deepest_llama_13b_width_model_that_compiles_is_near_the_memory_bound() {
    // 60 layers were refused before the host trade; 68 (21.9B parameters) need more than
    // 256 GiB at 14 bytes per parameter.
    let (mut fits, mut refused) = (60u64, 68u64);
    let mut best = compile(fits).expect("60 layers fit with gradients in the parameter chunks");
    assert!(compile(refused).is_none(), "{refused} layers compile");
    while refused - fits > 1 {
        let mid = (fits + refused) / 2;
        match compile(mid) {
            Some(s) => (fits, best) = (mid, s),
            None => refused = mid,
        }
    }
    let options = options();
    let m = best.header.prediction.memory;
    let overhead = m.activations + m.chunk_buffers + m.workspace + m.inputs;
    let memory = options.hardware.usable_device_bytes() + options.hardware.host_memory_bytes;
    let bound = (memory - overhead) / 14;
    let params = best.header.param_count;
    let fraction = params as f64 / bound as f64;
    eprintln!(
        "largest: {fits} layers, {params} parameters, policy {}; bound {bound} ({:.1}%); host \
         {} of {}, device {}",
        best.header.policy,
        100.0 * fraction,
        best.host_bytes,
        options.hardware.host_memory_bytes,
        best.arena_bytes
    );
    assert!(
        fraction >= 0.95,
        "{fits} layers ({params} parameters) is {:.1}% of the 14-byte bound {bound}",
        100.0 * fraction
    );
    protrain::ir::verify_schedule::verify(best).expect("the winner verifies");
}
