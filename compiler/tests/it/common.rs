//! Helpers the compiler's integration tests share.

use protrain_compiler::emit::HeaderInputs;

/// A schedule header for a test compilation: `model` and `hardware` as named, no budgets,
/// no report.
pub fn header(model: &str, hardware: &str) -> HeaderInputs {
    HeaderInputs {
        model: model.into(),
        hardware: hardware.into(),
        device_budget_bytes: u64::MAX,
        host_budget_bytes: u64::MAX,
        report: String::new(),
        flash_attention: true,
    }
}
