//! Graphs made elsewhere: what their files hold. The sets themselves are described by [`crate::graphset`] and run by
//! [`crate::engine::DecoderEngine`]; [`constants`] reads the compressed weights an IR holds, so that the reference
//! can be checked to run exactly those.

pub mod constants;
