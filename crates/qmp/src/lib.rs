//! Minimal QMP client: the capabilities handshake and commands, chiefly
//! `query-cpus-fast`, to map each guest vCPU to its host thread. Events interleaved with replies are skipped.

use anyhow::{bail, Context, Result};
use serde_json::Value;
use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

fn reply(reader: &mut impl BufRead) -> Result<Value> {
    let mut line = String::new();
    for _ in 0..1000 {
        line.clear();
        if reader.read_line(&mut line)? == 0 {
            bail!("QMP closed the connection");
        }
        let v: Value =
            serde_json::from_str(line.trim()).with_context(|| format!("bad QMP line {line:?}"))?;
        if v.get("event").is_some() || v.get("QMP").is_some() {
            continue;
        }
        if let Some(e) = v.get("error") {
            bail!("QMP error: {e}");
        }
        return v
            .get("return")
            .cloned()
            .context("QMP reply without \"return\"");
    }
    bail!("no QMP reply")
}

/// Parses a `query-cpus-fast` return value into (vCPU index, host thread id), sorted.
pub fn parse_cpus(ret: &Value) -> Result<Vec<(u32, u32)>> {
    let mut cpus = Vec::new();
    for c in ret
        .as_array()
        .context("query-cpus-fast did not return a list")?
    {
        let idx = c["cpu-index"].as_u64().context("cpu without cpu-index")? as u32;
        let tid = c["thread-id"].as_u64().context("cpu without thread-id")? as u32;
        cpus.push((idx, tid));
    }
    cpus.sort_unstable();
    Ok(cpus)
}

/// Runs `commands` (QMP command names without arguments) on the VM behind `socket`, after
/// the capabilities handshake; their return values in order.
pub fn execute(socket: &Path, commands: &[&str]) -> Result<Vec<Value>> {
    let commands: Vec<Value> = commands
        .iter()
        .map(|c| serde_json::json!({ "execute": c }))
        .collect();
    execute_json(socket, &commands)
}

/// Runs whole QMP commands (`{"execute": .., "arguments": ..}`) on the VM behind `socket`,
/// after the capabilities handshake; their return values in order.
pub fn execute_json(socket: &Path, commands: &[Value]) -> Result<Vec<Value>> {
    let stream = UnixStream::connect(socket)
        .with_context(|| format!("connecting to QMP {}", socket.display()))?;
    stream.set_read_timeout(Some(Duration::from_secs(5)))?;
    let mut writer = stream.try_clone()?;
    let mut reader = BufReader::new(stream);
    let mut greeting = String::new();
    reader.read_line(&mut greeting)?;
    anyhow::ensure!(
        greeting.contains("\"QMP\""),
        "not a QMP socket: {greeting:?}"
    );
    writer.write_all(b"{\"execute\":\"qmp_capabilities\"}\n")?;
    reply(&mut reader)?;
    commands
        .iter()
        .map(|c| {
            writer.write_all(format!("{c}\n").as_bytes())?;
            reply(&mut reader).with_context(|| format!("QMP {}", c["execute"]))
        })
        .collect()
}

/// The host thread of every vCPU of the VM behind `socket`, in vCPU order.
pub fn vcpu_threads(socket: &Path) -> Result<Vec<u32>> {
    let ret = execute(socket, &["query-cpus-fast"])?;
    let cpus = parse_cpus(&ret[0])?;
    Ok(cpus.into_iter().map(|(_, tid)| tid).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_qemu_7_output() {
        let ret: Value = serde_json::from_str(
            r#"[{"thread-id":4012,"props":{"core-id":0,"thread-id":0,"socket-id":1},"qom-path":"/machine/unattached/device[2]","cpu-index":1,"target":"x86_64"},
                {"thread-id":4011,"props":{"core-id":0,"thread-id":0,"socket-id":0},"qom-path":"/machine/unattached/device[0]","cpu-index":0,"target":"x86_64"}]"#,
        )
        .unwrap();
        assert_eq!(parse_cpus(&ret).unwrap(), vec![(0, 4011), (1, 4012)]);
        assert!(parse_cpus(&serde_json::json!({"x": 1})).is_err());
    }
}
