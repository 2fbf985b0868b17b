//! # ferry-plugin
//!
//! The plugin SDK (work in progress).
