//! The guest daemon's configuration loader on any text: an error or a configuration that
//! survives its own serialisation (what `default-config` prints must load again).
#![no_main]

use libfuzzer_sys::fuzz_target;
use vmigrater::config::Config;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    if let Ok(cfg) = Config::parse(text, "fuzz.toml") {
        let again = toml::to_string(&cfg).expect("a loaded configuration serialises");
        if let Err(e) = Config::parse(&again, "again.toml") {
            panic!("a loaded configuration does not load again: {e:#}\n{again}");
        }
    }
});
