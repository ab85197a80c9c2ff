//! One value of a row, typed as its column says.

use rankscope_core::tables::ColumnType;
use serde_json::{json, Value};

#[derive(Debug, Clone, PartialEq)]
pub enum Cell {
    Null,
    Int(i64),
    Float(f64),
    Bool(bool),
    Str(String),
    /// A text-to-text map (a snapshot's locals: name to repr), in order.
    Map(Vec<(String, String)>),
}

impl Cell {
    /// The value as its column's type: a producer that hands an int to a
    /// float column (or the reverse) still gets a typed column on disk;
    /// what cannot be converted is null.
    pub fn coerce(self, ty: ColumnType) -> Cell {
        match (ty, self) {
            (_, Cell::Null) => Cell::Null,
            (ColumnType::Int64 | ColumnType::Timestamp, Cell::Float(f)) if f.is_finite() => {
                Cell::Int(f as i64)
            }
            (ColumnType::Int64 | ColumnType::Timestamp, Cell::Bool(b)) => Cell::Int(b as i64),
            (ColumnType::Int64 | ColumnType::Timestamp, cell @ Cell::Int(_)) => cell,
            (ColumnType::Float64, Cell::Int(i)) => Cell::Float(i as f64),
            (ColumnType::Float64, cell @ Cell::Float(_)) => cell,
            (ColumnType::Bool, cell @ Cell::Bool(_)) => cell,
            (ColumnType::Bool, Cell::Int(i)) => Cell::Bool(i != 0),
            (ColumnType::Utf8, cell @ Cell::Str(_)) => cell,
            (ColumnType::MapUtf8, cell @ Cell::Map(_)) => cell,
            (ColumnType::Utf8, Cell::Int(i)) => Cell::Str(i.to_string()),
            (ColumnType::Utf8, Cell::Float(f)) => Cell::Str(f.to_string()),
            (ColumnType::Utf8, Cell::Bool(b)) => Cell::Str(b.to_string()),
            _ => Cell::Null,
        }
    }

    pub fn to_json(&self) -> Value {
        match self {
            Cell::Null => Value::Null,
            Cell::Int(i) => json!(i),
            // JSON has no NaN or infinity: they go as text, which the
            // CLI's float column reads back (a NaN loss must stay visible).
            Cell::Float(f) if !f.is_finite() => json!(f.to_string()),
            Cell::Float(f) => json!(f),
            Cell::Bool(b) => json!(b),
            Cell::Str(s) => json!(s),
            Cell::Map(entries) => Value::Object(
                entries
                    .iter()
                    .map(|(k, v)| (k.clone(), Value::String(v.clone())))
                    .collect(),
            ),
        }
    }

    /// `cell op value` for a pushed-down filter. A null cell meets nothing;
    /// values of another kind than the cell are let through (the engine
    /// filters again, so letting through is never wrong).
    pub fn meets(&self, op: &str, value: &Value) -> bool {
        use std::cmp::Ordering;
        let order = match (self, value) {
            (Cell::Null, _) => return false,
            (Cell::Int(a), Value::Number(b)) => match b.as_i64() {
                Some(b) => Some(a.cmp(&b)),
                None => b.as_f64().and_then(|b| (*a as f64).partial_cmp(&b)),
            },
            (Cell::Float(a), Value::Number(b)) => b.as_f64().and_then(|b| a.partial_cmp(&b)),
            (Cell::Str(a), Value::String(b)) => Some(a.as_str().cmp(b.as_str())),
            (Cell::Bool(a), Value::Bool(b)) => Some(a.cmp(b)),
            _ => return true,
        };
        let Some(order) = order else { return false };
        match op {
            "=" => order == Ordering::Equal,
            "<" => order == Ordering::Less,
            "<=" => order != Ordering::Greater,
            ">" => order == Ordering::Greater,
            ">=" => order != Ordering::Less,
            _ => true,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_take_their_columns_type() {
        assert_eq!(Cell::Int(3).coerce(ColumnType::Float64), Cell::Float(3.0));
        assert_eq!(Cell::Float(2.9).coerce(ColumnType::Int64), Cell::Int(2));
        assert_eq!(Cell::Float(f64::NAN).coerce(ColumnType::Int64), Cell::Null);
        assert_eq!(Cell::Str("x".into()).coerce(ColumnType::Int64), Cell::Null);
        assert_eq!(Cell::Int(1).coerce(ColumnType::Bool), Cell::Bool(true));
        let locals = Cell::Map(vec![("loss".into(), "0.5".into())]);
        assert_eq!(locals.clone().coerce(ColumnType::MapUtf8), locals);
        assert_eq!(locals.to_json(), json!({"loss": "0.5"}));
        assert_eq!(
            Cell::Str("x".into()).coerce(ColumnType::MapUtf8),
            Cell::Null
        );
    }

    #[test]
    fn filters_compare_like_sql_and_null_meets_nothing() {
        assert!(Cell::Int(5).meets(">", &json!(4)));
        assert!(Cell::Int(5).meets("<=", &json!(5.5)));
        assert!(!Cell::Float(f64::NAN).meets("=", &json!(1.0)));
        assert!(Cell::Str("fc1".into()).meets("=", &json!("fc1")));
        assert!(!Cell::Null.meets("=", &json!(1)));
        assert!(
            Cell::Int(1).meets("=", &json!("text")),
            "another kind is let through"
        );
    }

    #[test]
    fn non_finite_floats_go_as_text() {
        assert_eq!(Cell::Float(f64::INFINITY).to_json(), json!("inf"));
        assert_eq!(Cell::Float(f64::NAN).to_json(), json!("NaN"));
    }
}
