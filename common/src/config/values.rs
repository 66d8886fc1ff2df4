//! Building blocks of the sections' `Default` impls: byte sizes and non-zero literals.

use std::num::{NonZeroU16, NonZeroU32, NonZeroUsize};

pub(super) const KIB: usize = 1024;
pub(super) const MIB: usize = 1024 * 1024;

/// Shorthand for non-zero literals in `Default` impls; a zero is a bug caught by the tests.
pub(super) fn nz32(v: u32) -> NonZeroU32 {
    NonZeroU32::new(v).expect("default must be non-zero")
}
pub(super) fn nz16(v: u16) -> NonZeroU16 {
    NonZeroU16::new(v).expect("default must be non-zero")
}
pub(super) fn nzu(v: usize) -> NonZeroUsize {
    NonZeroUsize::new(v).expect("default must be non-zero")
}
