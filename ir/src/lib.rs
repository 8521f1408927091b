//! protrain's IR: the data model shared by the compiler and the runtime.
//!
//! It holds data, its printers (canonical text, DOT, JSON) and its verifier; it holds no pass.

pub mod chunks;
pub mod dot;
pub mod error;
pub mod experts;
pub mod graph;
pub mod hardware;
pub mod ids;
pub mod op;
pub mod policy;
pub mod print;
pub mod schedule;
pub mod types;
pub mod verify;
pub mod verify_movement;
pub mod workspace;

pub mod file;
pub mod output;
pub mod print_schedule;
pub mod verify_schedule;

pub use chunks::{Chunk, ChunkMember, ChunkSizeTrial, ChunkTable};
pub use error::{IrError, Result};
pub use experts::ExpertPlacement;
pub use graph::{Block, BlockKind, Graph, GraphInfo, Location, Param, ParamInit, Role, Value};
pub use hardware::{
    op_key, Disk, HardwareProfile, Interconnect, MeasuredOp, PeakFlops, Resource, PRESETS,
};
pub use ids::{BlockId, BufferId, ChunkId, EventId, OpId, ParamId, StreamId, ValueId};
pub use op::{
    Epilogue, Movement, Op, OpKind, Phase, QkvLayout, RopeScaling, WeightLayout,
    LOSS_SCALE_GROWTH_INTERVAL, LOSS_SCALE_INIT,
};
pub use policy::{
    format_blocks, parse_blocks, BlockMode, HostLayout, MicroBatchOrder, Policy, PolicySpec,
};
pub use print_schedule::{BufferNumbering, PrintOptions};
pub use schedule::{
    Buffer, BufferKind, CastPiece, CopyKind, Header, Instr, MemoryBreakdown, Prediction, RowPitch,
    Schedule, ShardPart, Space, Stream, StreamKind, TensorRef, FORMAT_VERSION, ROW_PITCH_ALIGN,
};
pub use types::{format_bytes, format_count, DType, TensorType};
pub use verify_schedule::VerifiedSchedule;
pub use workspace::{norm_rows, Region, Scratch, WorkspaceLayout, WORKSPACE_ALIGN};

impl Graph {
    /// The canonical text form; see [`print::print_graph`].
    pub fn to_text(&self) -> String {
        print::print_graph(self)
    }

    /// Graphviz DOT; see [`dot::print_dot`].
    pub fn to_dot(&self) -> String {
        dot::print_dot(self)
    }
}
