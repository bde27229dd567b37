//! The parity harness: the dump format every backend writes, and the run options the command line parses.
#![deny(missing_docs)]

pub mod bundled;
pub mod device;
pub mod dump;
pub mod options;
