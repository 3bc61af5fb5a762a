//! The generated skeletons of bpf/irqsteal.bpf.c and bpf/hostmodel.bpf.c.
#![allow(
    clippy::all,
    clippy::pedantic,
    dead_code,
    non_camel_case_types,
    non_snake_case,
    non_upper_case_globals
)]
include!(concat!(env!("OUT_DIR"), "/irqsteal.skel.rs"));

pub mod hostmodel {
    #![allow(
        clippy::all,
        clippy::pedantic,
        dead_code,
        non_camel_case_types,
        non_snake_case,
        non_upper_case_globals
    )]
    include!(concat!(env!("OUT_DIR"), "/hostmodel.skel.rs"));
}
