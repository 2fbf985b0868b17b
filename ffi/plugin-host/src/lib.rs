//! # ferry-plugin-host
//!
//! The plugin loader (work in progress).
