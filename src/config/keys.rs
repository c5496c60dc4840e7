//! Parsing deck text: aliases, `--set` overrides, unknown keys with the closest valid one.
use super::{ConfigError, Deck};

pub(super) fn parse(text: &str, overrides: &[String]) -> Result<Deck, ConfigError> {
    let mut table: toml::Table = text.parse().map_err(|e: toml::de::Error| ConfigError::new(e.message().to_string()))?;
    for o in overrides {
        let (path, value) = o.split_once('=').ok_or_else(|| ConfigError::new(format!("--set {o}: expected table.key=value")))?;
        let (t, k) = path.trim().split_once('.').ok_or_else(|| ConfigError::new(format!("--set {o}: expected table.key=value")))?;
        let v: toml::Value = format!("v = {}", value.trim())
            .parse::<toml::Table>()
            .ok()
            .and_then(|mut t| t.remove("v"))
            .unwrap_or_else(|| toml::Value::String(value.trim().to_string()));
        table
            .entry(t.to_string())
            .or_insert_with(|| toml::Value::Table(Default::default()))
            .as_table_mut()
            .ok_or_else(|| ConfigError::new(format!("--set {o}: {t} is not a table")))?
            .insert(k.to_string(), v);
    }
    toml::Value::Table(table).try_into().map_err(|e: toml::de::Error| ConfigError::new(e.message().to_string()))
}
