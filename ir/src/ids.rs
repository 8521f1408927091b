//! Typed entity ids: `u32` newtypes that index the IR's tables.

use serde::{Deserialize, Serialize};
use std::fmt;

macro_rules! entity {
    ($(#[$doc:meta])* $name:ident, $prefix:literal) => {
        $(#[$doc])*
        #[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
        #[serde(transparent)]
        pub struct $name(pub u32);

        impl $name {
            /// The id of the `index`-th entity of this kind.
            ///
            /// Panics if `index` does not fit in a `u32`: no table the IR builds comes near it.
            pub fn new(index: usize) -> Self {
                Self(u32::try_from(index).expect(concat!(stringify!($name), " overflowed u32")))
            }

            /// The table index this id stands for.
            pub fn index(self) -> usize {
                self.0 as usize
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, concat!($prefix, "{}"), self.0)
            }
        }
    };
}

entity!(
    /// An operation in a [`Graph`](crate::Graph).
    OpId,
    "op"
);
entity!(
    /// An SSA tensor value in a [`Graph`](crate::Graph).
    ValueId,
    "%"
);
entity!(
    /// A trainable parameter of a [`Graph`](crate::Graph).
    ParamId,
    "param"
);
entity!(
    /// A block of a [`Graph`](crate::Graph): the embeddings, one transformer layer, or the head.
    BlockId,
    "block"
);
entity!(
    /// A parameter chunk.
    ChunkId,
    "chunk"
);
entity!(
    /// A buffer of a schedule: a tensor at a fixed offset in the device arena or host region.
    BufferId,
    "buf"
);
entity!(
    /// A stream of a schedule: an in-order instruction list.
    StreamId,
    "stream"
);
entity!(
    /// An event of a schedule: recorded on one stream, waited on by others.
    EventId,
    "event"
);
