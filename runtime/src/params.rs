//! Parameter values: seeded random initialisation, loading from a Hugging Face checkpoint, and
//! saving back under the same names.

use crate::error::{Result, RuntimeError};
use crate::rng::Rng;
use crate::weights::{
    safetensors_order, save_safetensors, save_safetensors_streamed, ExpectedTensor, StorageDtype,
    WeightFile,
};
use protrain_ir::{Graph, ParamInit};
use std::path::Path;

/// Initial values of every parameter, in parameter order, as the graph's [`ParamInit`]s say.
///
/// Each parameter draws from its own stream, seeded by `seed` and its index, so its values do
/// not depend on the other parameters' sizes. Normal draws use Box-Muller.
pub fn init_params(graph: &Graph, seed: u64) -> Vec<Vec<f32>> {
    use rayon::prelude::*;
    // Each parameter has its own stream, so drawing them in parallel changes no bit.
    let params: Vec<_> = graph.params().collect();
    params
        .into_par_iter()
        .map(|(id, p)| {
            let n = graph.value(p.value).ty.numel() as usize;
            match p.init {
                ParamInit::Ones => vec![1.0; n],
                ParamInit::Zeros => vec![0.0; n],
                ParamInit::Normal { std } => Rng::stream(seed, u64::from(id.0)).normal_vec(n, std),
            }
        })
        .collect()
}

/// What a checkpoint must hold for this graph: each parameter by its Hugging Face name or an
/// alias, with its shape.
pub fn expected_tensors(graph: &Graph) -> Vec<ExpectedTensor> {
    graph
        .params()
        .map(|(_, p)| {
            let shape: Vec<usize> = graph
                .value(p.value)
                .ty
                .shape
                .iter()
                .map(|&d| d as usize)
                .collect();
            p.aliases
                .iter()
                .fold(ExpectedTensor::new(p.name.clone(), shape), |e, alias| {
                    e.alias(alias.clone())
                })
        })
        .collect()
}

/// Loads every parameter from a Hugging Face safetensors checkpoint (a file, a sharded
/// index, or a directory), converting to f32. Fails, listing the first mismatches, when the
/// checkpoint's names or shapes are not this model's.
pub fn load_params(graph: &Graph, path: &Path) -> Result<Vec<Vec<f32>>> {
    let file = WeightFile::open(path)?;
    let names = file.check_against(&expected_tensors(graph))?;
    names.iter().map(|name| file.read_f32_vec(name)).collect()
}

/// [`save_params`] with each parameter's values read when it is written, by `read` (given
/// its index in parameter order), in [`save_order`]: the writer holds one parameter at a
/// time, so a rank of a sharded run writes the whole model holding one tensor beyond its
/// shards. The bytes are [`save_params`]'.
pub fn save_params_streamed(
    graph: &Graph,
    path: &Path,
    dtype: StorageDtype,
    read: &mut dyn FnMut(usize) -> Result<Vec<f32>>,
) -> Result<()> {
    let shapes: Vec<Vec<usize>> = graph
        .params()
        .map(|(_, p)| {
            let shape = &graph.value(p.value).ty.shape;
            shape.iter().map(|&d| d as usize).collect()
        })
        .collect();
    let specs: Vec<(&str, &[usize])> = graph
        .params()
        .zip(&shapes)
        .map(|((_, p), shape)| (p.name.as_str(), shape.as_slice()))
        .collect();
    save_safetensors_streamed(path, &specs, dtype, &[], read)
}

/// The order [`save_params_streamed`] reads the parameters in (indices in parameter order):
/// the file's, sorted by name. The other ranks of a sharded run read the weights in this
/// order too, to join each gather.
pub fn save_order(graph: &Graph) -> Vec<usize> {
    safetensors_order(graph.params().map(|(_, p)| p.name.as_str()))
}

/// Saves parameters under their Hugging Face names (tied aliases are not written twice, as
/// `save_pretrained` does), atomically.
pub fn save_params(
    graph: &Graph,
    values: &[Vec<f32>],
    path: &Path,
    dtype: StorageDtype,
) -> Result<()> {
    let shapes: Vec<Vec<usize>> = graph
        .params()
        .map(|(_, p)| {
            graph
                .value(p.value)
                .ty
                .shape
                .iter()
                .map(|&d| d as usize)
                .collect()
        })
        .collect();
    let tensors: Vec<(&str, &[usize], &[f32])> = graph
        .params()
        .zip(&shapes)
        .zip(values)
        .map(|(((_, p), shape), data)| (p.name.as_str(), shape.as_slice(), data.as_slice()))
        .collect();
    save_safetensors(path, &tensors, dtype, &[])
}

/// Fails when a parameter of `values` (in `graph`'s parameter order) holds NaN or infinity,
/// naming it and where the weights came from: training from them can only give a NaN loss.
pub(crate) fn check_finite(values: &[Vec<f32>], graph: &Graph, origin: &str) -> Result<()> {
    for ((_, p), data) in graph.params().zip(values) {
        if let Some(&value) = data.iter().find(|v| !v.is_finite()) {
            return Err(RuntimeError::NonFiniteWeights {
                origin: origin.to_string(),
                name: p.name.clone(),
                value,
                count: data.iter().filter(|v| !v.is_finite()).count(),
                len: data.len(),
            });
        }
    }
    Ok(())
}
