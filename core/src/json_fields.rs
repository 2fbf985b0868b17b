//! JSON helpers shared by the config and descriptor decoders: the keys a serde struct reads
//! (so known-field lists are not kept by hand), the members of an object outside them (kept as
//! unknown fields), and serde_json's messages without their position (the callers report it).

use serde::de::{DeserializeOwned, Deserializer, Visitor};
use serde_json::{Map, Value};

/// The JSON keys a `#[derive(Deserialize)]` struct reads, as serde lists them (renamed, without
/// skipped or flattened fields), so that lists of known keys are not kept by hand.
pub(crate) fn serde_fields<T: DeserializeOwned>() -> &'static [&'static str] {
    /// A deserializer that only records the field list a struct's `Deserialize` passes it.
    struct Probe<'a>(&'a mut &'static [&'static str]);

    impl<'de> Deserializer<'de> for Probe<'_> {
        type Error = serde::de::value::Error;

        fn deserialize_any<V: Visitor<'de>>(self, _: V) -> std::result::Result<V::Value, Self::Error> {
            Err(serde::de::Error::custom("not a struct"))
        }

        fn deserialize_struct<V: Visitor<'de>>(
            self,
            _: &'static str,
            fields: &'static [&'static str],
            _: V,
        ) -> std::result::Result<V::Value, Self::Error> {
            *self.0 = fields;
            Err(serde::de::Error::custom("fields recorded"))
        }

        serde::forward_to_deserialize_any! {
            bool i8 i16 i32 i64 i128 u8 u16 u32 u64 u128 f32 f64 char str string bytes byte_buf option unit
            unit_struct newtype_struct seq tuple tuple_struct map enum identifier ignored_any
        }
    }

    let mut fields: &'static [&'static str] = &[];
    let _ = T::deserialize(Probe(&mut fields));
    fields
}

/// The members of JSON object `value` whose names are not in `known`.
pub(crate) fn unknown_fields(value: &Value, known: &[&str]) -> Map<String, Value> {
    value
        .as_object()
        .map(|o| o.iter().filter(|(k, _)| !known.contains(&k.as_str())).map(|(k, v)| (k.clone(), v.clone())).collect())
        .unwrap_or_default()
}

/// Removes serde_json's trailing " at line L column C" (the caller reports the position).
pub(crate) fn strip_position(msg: &str) -> String {
    match msg.rfind(" at line ") {
        Some(i) if msg[i..].contains(" column ") => msg[..i].to_owned(),
        _ => msg.to_owned(),
    }
}
