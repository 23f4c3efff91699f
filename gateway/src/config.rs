//! The configuration file (`--config FILE`, TOML): its keys are the `serve` flags' long
//! names with `_` for `-` (`kv_bytes = "8G"`). Precedence: flags, then environment, then
//! the file, then defaults. Implemented on the command line itself: every key of the file
//! whose flag was given neither as a flag nor through its environment variable becomes that
//! flag, so clap validates file values exactly as it validates flags. `config --print`
//! shows the effective values as TOML.

use std::ffi::OsString;
use std::path::PathBuf;

use clap::{ArgAction, ArgMatches, Command};

/// The flag naming the file, and its environment variable.
const CONFIG_FLAG: &str = "--config";
const CONFIG_ENV: &str = "DUET_CONFIG";
/// Subcommands that take the serve flags (and so a config file).
const WITH_CONFIG: [&str; 2] = ["serve", "config"];
/// Flags that are not configuration.
const NOT_CONFIG: [&str; 3] = ["config", "print", "help"];

/// `argv` with the configuration file's values added as flags where neither a flag nor an
/// environment variable sets them. Without a config file, `argv` unchanged.
pub fn apply(cmd: &Command, argv: Vec<OsString>) -> Result<Vec<OsString>, String> {
    let Some(sub_at) = argv.iter().position(|a| WITH_CONFIG.iter().any(|s| a == s)) else { return Ok(argv) };
    let Some(path) = config_path(&argv[sub_at + 1..]) else { return Ok(argv) };
    let sub_name = argv[sub_at].to_string_lossy().into_owned();
    let sub = cmd.find_subcommand(&sub_name).ok_or_else(|| format!("no subcommand {sub_name}"))?;
    let text = std::fs::read_to_string(&path).map_err(|e| format!("reading the config file {}: {e}", path.display()))?;
    let table: toml::Table = text.parse().map_err(|e| format!("the config file {} is not valid TOML: {e}", path.display()))?;
    let given: Vec<String> = argv[sub_at + 1..].iter().map(|a| a.to_string_lossy().into_owned()).collect();
    let mut extra: Vec<OsString> = Vec::new();
    for (key, value) in &table {
        let arg = sub
            .get_arguments()
            .find(|a| a.get_id().as_str() == key && !NOT_CONFIG.contains(&key.as_str()) && a.get_long().is_some())
            .ok_or_else(|| format!("{}: unknown key {key:?}; the keys are: {}", path.display(), config_keys(sub).join(", ")))?;
        let long = format!("--{}", arg.get_long().expect("checked"));
        let on_command_line = given.iter().any(|g| *g == long || g.starts_with(&format!("{long}=")));
        let in_env = arg.get_env().is_some_and(|e| std::env::var_os(e).is_some());
        if on_command_line || in_env {
            continue;
        }
        let bad = |what: &str| format!("{}: {key} must be {what}", path.display());
        match (arg.get_action(), value) {
            (ArgAction::SetTrue, toml::Value::Boolean(b)) => {
                if *b {
                    extra.push(long.into());
                }
            }
            (ArgAction::SetTrue, _) => return Err(bad("true or false")),
            (_, toml::Value::Array(items)) => {
                for item in items {
                    extra.push(format!("{long}={}", scalar(item).ok_or_else(|| bad("a list of strings or numbers"))?).into());
                }
            }
            (_, v) => extra.push(format!("{long}={}", scalar(v).ok_or_else(|| bad("a string, number or boolean"))?).into()),
        }
    }
    let mut out = argv;
    out.splice(sub_at + 1..sub_at + 1, extra);
    Ok(out)
}

fn scalar(v: &toml::Value) -> Option<String> {
    match v {
        toml::Value::String(s) => Some(s.clone()),
        toml::Value::Integer(i) => Some(i.to_string()),
        toml::Value::Float(f) => Some(f.to_string()),
        toml::Value::Boolean(b) => Some(b.to_string()),
        _ => None,
    }
}

/// `--config FILE`, `--config=FILE`, or `$DUET_CONFIG`.
fn config_path(args: &[OsString]) -> Option<PathBuf> {
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let s = a.to_string_lossy();
        if s == CONFIG_FLAG {
            return it.next().map(PathBuf::from);
        }
        if let Some(p) = s.strip_prefix(&format!("{CONFIG_FLAG}=")) {
            return Some(PathBuf::from(p));
        }
    }
    std::env::var_os(CONFIG_ENV).map(PathBuf::from)
}

fn config_keys(sub: &Command) -> Vec<String> {
    sub.get_arguments()
        .filter(|a| a.get_long().is_some() && !NOT_CONFIG.contains(&a.get_id().as_str()))
        .map(|a| a.get_id().to_string())
        .collect()
}

/// The effective configuration of a parsed `config` (or `serve`) subcommand as TOML: every
/// key with a value, whichever source gave it.
pub fn render(sub: &Command, matches: &ArgMatches) -> String {
    let mut table = toml::Table::new();
    for arg in sub.get_arguments().filter(|a| a.get_long().is_some() && !NOT_CONFIG.contains(&a.get_id().as_str())) {
        let id = arg.get_id().as_str();
        if matches!(arg.get_action(), ArgAction::SetTrue) {
            table.insert(id.into(), toml::Value::Boolean(matches.get_flag(id)));
            continue;
        }
        let Some(raw) = matches.get_raw(id) else { continue };
        let values: Vec<toml::Value> = raw.map(|v| typed(&v.to_string_lossy())).collect();
        let multiple = matches!(arg.get_action(), ArgAction::Append) || arg.get_value_delimiter().is_some();
        let value = if multiple { toml::Value::Array(values) } else { values.into_iter().next().unwrap_or(toml::Value::String(String::new())) };
        table.insert(id.into(), value);
    }
    toml::to_string(&table).unwrap_or_default()
}

fn typed(s: &str) -> toml::Value {
    s.parse::<i64>().map(toml::Value::Integer).unwrap_or_else(|_| toml::Value::String(s.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cli::Cli;
    use clap::CommandFactory;

    fn os(v: &[&str]) -> Vec<OsString> {
        v.iter().map(OsString::from).collect()
    }

    fn with_file(text: &str, f: impl FnOnce(&str)) {
        static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let path = std::env::temp_dir().join(format!("duet-config-{}-{n}.toml", std::process::id()));
        std::fs::write(&path, text).unwrap();
        f(path.to_str().unwrap());
        std::fs::remove_file(&path).unwrap();
    }

    #[test]
    fn file_values_fill_what_flags_leave() {
        let cmd = Cli::command();
        with_file("kv_bytes = \"8G\"\nmax_step_tokens = 1024\nlisten = \"127.0.0.1:6000\"\ncpu_worker = [\"unix:/a\", \"unix:/b\"]\n", |p| {
            let argv = apply(&cmd, os(&["duet-gateway", "serve", "--config", p, "--listen", "127.0.0.1:7000"])).unwrap();
            let m = cmd.clone().try_get_matches_from(&argv).unwrap_err();
            // cpu_worker requires gpu_worker: clap checks file values like flags.
            assert!(m.to_string().contains("--gpu-worker"), "{m}");
        });
        with_file("kv_bytes = \"8G\"\nmax_step_tokens = 1024\nlisten = \"127.0.0.1:6000\"\n", |p| {
            let argv = apply(&cmd, os(&["duet-gateway", "config", "--print", "--config", p, "--listen", "127.0.0.1:7000"])).unwrap();
            let m = cmd.clone().try_get_matches_from(&argv).unwrap();
            let (name, sub_m) = m.subcommand().unwrap();
            let text = render(cmd.find_subcommand(name).unwrap(), sub_m);
            let t: toml::Table = text.parse().unwrap();
            assert_eq!(t["kv_bytes"].as_str(), Some("8G"));
            assert_eq!(t["max_step_tokens"].as_integer(), Some(1024));
            assert_eq!(t["listen"].as_str(), Some("127.0.0.1:7000"), "the flag wins over the file");
            assert_eq!(t["max_running"].as_integer(), Some(64), "defaults shown");
        });
    }

    #[test]
    fn bad_files_are_refused_with_the_reason() {
        let cmd = Cli::command();
        with_file("kv_byts = \"8G\"\n", |p| {
            let e = apply(&cmd, os(&["duet-gateway", "serve", "--config", p])).unwrap_err();
            assert!(e.contains("unknown key \"kv_byts\"") && e.contains("kv_bytes"), "{e}");
        });
        with_file("kv_bytes = [1, {a = 2}]\n", |p| {
            let e = apply(&cmd, os(&["duet-gateway", "serve", "--config", p])).unwrap_err();
            assert!(e.contains("kv_bytes must be a list"), "{e}");
        });
        with_file("kv_bytes = \n", |p| {
            let e = apply(&cmd, os(&["duet-gateway", "serve", "--config", p])).unwrap_err();
            assert!(e.contains("not valid TOML"), "{e}");
        });
        let e = apply(&cmd, os(&["duet-gateway", "serve", "--config", "/nonexistent/duet.toml"])).unwrap_err();
        assert!(e.contains("reading the config file /nonexistent/duet.toml"), "{e}");
        with_file("max_running = \"many\"\n", |p| {
            let argv = apply(&cmd, os(&["duet-gateway", "serve", "--config", p])).unwrap();
            let e = cmd.clone().try_get_matches_from(&argv).unwrap_err().to_string();
            assert!(e.contains("many"), "{e}");
        });
    }
}
