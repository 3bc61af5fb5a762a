//! The generated skeleton of bpf/irqsteal.bpf.c.
#![allow(
    clippy::all,
    clippy::pedantic,
    dead_code,
    non_camel_case_types,
    non_snake_case,
    non_upper_case_globals
)]
include!(concat!(env!("OUT_DIR"), "/irqsteal.skel.rs"));
