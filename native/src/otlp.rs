//! A finished trace's spans as OTLP protobuf bytes (`router_runtime/tracing/wire.py` wraps these).
//!
//! Why native: written in Python, the encoding was over half of tracing's own work per request
//! (bench/README.md, "The cost of tracing"). The fields are OTLP v1's `trace.proto` and
//! `common.proto`. The protobuf writing is pure; the Python shell below it (`encode_spans`,
//! `encode_attributes`) walks `tracing/spans.py`'s objects.

use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyBytes, PyDict, PyFloat, PyInt, PyList, PyString, PyTuple};

/// `n` as a protobuf varint (a negative int64 goes as its ten-byte two's complement).
pub fn put_varint(out: &mut Vec<u8>, mut n: u64) {
    while n > 0x7F {
        out.push((n as u8 & 0x7F) | 0x80);
        n >>= 7;
    }
    out.push(n as u8);
}

/// A length-delimited field whose payload `write` appends (what `write` returns is returned). The
/// length is written after the payload, in the one byte reserved for it, or moved up to make room when
/// it needs more.
pub fn put_nested<R>(out: &mut Vec<u8>, tag: u8, write: impl FnOnce(&mut Vec<u8>) -> R) -> R {
    out.push(tag);
    let at = out.len();
    out.push(0);
    let r = write(out);
    let n = out.len() - at - 1;
    if n < 0x80 {
        out[at] = n as u8;
    } else {
        let mut len = Vec::with_capacity(10);
        put_varint(&mut len, n as u64);
        out.splice(at..at + 1, len);
    }
    r
}

pub fn put_bytes(out: &mut Vec<u8>, tag: u8, payload: &[u8]) {
    out.push(tag);
    put_varint(out, payload.len() as u64);
    out.extend_from_slice(payload);
}

pub fn put_fixed64(out: &mut Vec<u8>, tag: u8, v: u64) {
    out.push(tag);
    out.extend_from_slice(&v.to_le_bytes());
}

// AnyValue's fields: string_value 1, bool_value 2, int_value 3, double_value 4, array_value 5.
pub fn any_str(out: &mut Vec<u8>, s: &str) {
    put_bytes(out, 0x0a, s.as_bytes());
}

pub fn any_bool(out: &mut Vec<u8>, b: bool) {
    out.extend_from_slice(&[0x10, b as u8]);
}

pub fn any_int(out: &mut Vec<u8>, v: i64) {
    out.push(0x18);
    put_varint(out, v as u64);
}

pub fn any_double(out: &mut Vec<u8>, v: f64) {
    put_fixed64(out, 0x21, v.to_bits());
}

/// An ArrayValue (AnyValue.array_value = 5) of the values `write` appends, each wrapped as
/// `ArrayValue.values` (1).
pub fn any_array<R>(out: &mut Vec<u8>, write: impl FnOnce(&mut Vec<u8>) -> R) -> R {
    put_nested(out, 0x2a, write)
}

/// One KeyValue (key 1, value 2) as the repeated field `tag` of its message; `value` appends an AnyValue.
pub fn key_value<R>(out: &mut Vec<u8>, tag: u8, key: &str, value: impl FnOnce(&mut Vec<u8>) -> R) -> R {
    put_nested(out, tag, |out| {
        put_bytes(out, 0x0a, key.as_bytes());
        put_nested(out, 0x12, value)
    })
}

/// Span.status (15) with code STATUS_CODE_ERROR (Status.code = 3, value 2).
pub const ERROR_STATUS: [u8; 4] = [0x7a, 0x02, 0x18, 0x02];

// The Python shell: tracing/spans.py's Span and its attribute values, read as they are.

/// Lists in lists deeper than this go as their text (a list that holds itself must not take the stack).
const MAX_DEPTH: u32 = 8;

/// An attribute value as OTLP's AnyValue: text, flag, int64, float, or a list of them (a None in a list
/// left out). Anything else, an int past int64 among them, goes as its text: never an error, so one
/// odd value cannot cost the batch it is in.
fn any_value(out: &mut Vec<u8>, v: &Bound<'_, PyAny>, depth: u32) -> PyResult<()> {
    if let Ok(s) = v.cast::<PyString>() {
        any_str(out, s.to_str()?);
    } else if let Ok(b) = v.cast::<PyBool>() {
        any_bool(out, b.is_true());
    } else if v.is_instance_of::<PyInt>() {
        match v.extract::<i64>() {
            Ok(i) => any_int(out, i),
            Err(_) => any_str(out, v.str()?.to_str()?),
        }
    } else if let Ok(f) = v.cast::<PyFloat>() {
        any_double(out, f.value());
    } else if depth < MAX_DEPTH && (v.is_instance_of::<PyList>() || v.is_instance_of::<PyTuple>()) {
        any_array(out, |out| -> PyResult<()> {
            for x in v.try_iter()? {
                let x = x?;
                if !x.is_none() {
                    put_nested(out, 0x0a, |out| any_value(out, &x, depth + 1))?;
                }
            }
            Ok(())
        })?;
    } else {
        any_str(out, v.str()?.to_str()?);
    }
    Ok(())
}

/// Each entry of `attrs` that has a value (None: the span does not have it) as the repeated field `tag`;
/// `error`, if given, as `error.type` (in that key's place if the span set one, else last).
fn attributes(out: &mut Vec<u8>, tag: u8, attrs: &Bound<'_, PyDict>, error: Option<&str>) -> PyResult<()> {
    let mut error = error;
    // A private copy to walk: a value's `__str__` may run Python that changes the dict, and PyO3's
    // dict iterator panics on that (a PanicException is no Exception: it would reach the request). A
    // copy, not `items()`: no tuple per entry.
    for (k, v) in attrs.copy()?.iter() {
        let key = k
            .cast::<PyString>()
            .map_err(|_| PyTypeError::new_err("an attribute's key is not text"))?;
        let key = key.to_str()?;
        if key == "error.type" {
            if let Some(e) = error.take() {
                key_value(out, tag, key, |out| any_str(out, e));
                continue;
            }
        }
        if v.is_none() {
            continue;
        }
        key_value(out, tag, key, |out| any_value(out, &v, 0))?;
    }
    if let Some(e) = error {
        key_value(out, tag, "error.type", |out| any_str(out, e));
    }
    Ok(())
}

/// One Span message's fields (trace_id 1, span_id 2, trace_state 3, parent_span_id 4, name 5, kind 6,
/// start 7, end 8, attributes 9, events 11, status 15).
fn span(out: &mut Vec<u8>, trace_id: &[u8; 16], trace_state: Option<&str>, s: &Bound<'_, PyAny>) -> PyResult<()> {
    let py = s.py();
    put_bytes(out, 0x0a, trace_id);
    put_bytes(
        out,
        0x12,
        &s.getattr(intern!(py, "span_id"))?.extract::<u64>()?.to_be_bytes(),
    );
    if let Some(state) = trace_state {
        put_bytes(out, 0x1a, state.as_bytes());
    }
    let parent: u64 = s.getattr(intern!(py, "parent_id"))?.extract()?;
    if parent != 0 {
        put_bytes(out, 0x22, &parent.to_be_bytes());
    }
    let name = s.getattr(intern!(py, "name"))?;
    put_bytes(out, 0x2a, name.cast::<PyString>()?.to_str()?.as_bytes());
    out.push(0x30);
    put_varint(out, s.getattr(intern!(py, "kind"))?.extract::<u64>()?);
    put_fixed64(out, 0x39, s.getattr(intern!(py, "start_ns"))?.extract()?);
    put_fixed64(out, 0x41, s.getattr(intern!(py, "end_ns"))?.extract()?);
    let error: Option<Bound<'_, PyString>> = s.getattr(intern!(py, "error"))?.extract()?;
    let error = error.as_ref().map(|e| e.to_str()).transpose()?;
    let attrs = s.getattr(intern!(py, "attributes"))?;
    attributes(out, 0x4a, attrs.cast::<PyDict>()?, error)?;
    // Span.events = 11: time_unix_nano 1, name 2, attributes 3.
    for event in s.getattr(intern!(py, "events"))?.cast::<PyList>()?.iter() {
        let (at, name, attrs): (u64, Bound<'_, PyString>, Bound<'_, PyDict>) = event.extract()?;
        put_nested(out, 0x5a, |out| {
            put_fixed64(out, 0x09, at);
            put_bytes(out, 0x12, name.to_str()?.as_bytes());
            attributes(out, 0x1a, &attrs, None)
        })?;
    }
    if error.is_some() {
        out.extend_from_slice(&ERROR_STATUS);
    }
    Ok(())
}

/// A finished trace's spans (tracing/spans.py's `Span`s, `root` among them) as ScopeSpans' repeated
/// `spans` field (2) holds them; the client's `tracestate` goes on the root. Raises on a value that is
/// not a span's (the exporter counts that trace as failed).
#[pyfunction]
pub fn encode_spans<'py>(
    py: Python<'py>,
    trace_id: u128,
    tracestate: Option<&str>,
    root: &Bound<'py, PyAny>,
    spans: &Bound<'py, PyList>,
) -> PyResult<Bound<'py, PyBytes>> {
    let trace_id = trace_id.to_be_bytes();
    let tracestate = tracestate.filter(|s| !s.is_empty());
    let mut out = Vec::with_capacity(512 * spans.len());
    for s in spans.iter() {
        let state = if s.is(root) { tracestate } else { None };
        put_nested(&mut out, 0x12, |out| span(out, &trace_id, state, &s))?;
    }
    Ok(PyBytes::new(py, &out))
}

/// `attrs` as the repeated KeyValue field `tag` of its message (a resource's, a span's, an event's).
#[pyfunction]
pub fn encode_attributes<'py>(py: Python<'py>, tag: u8, attrs: &Bound<'py, PyDict>) -> PyResult<Bound<'py, PyBytes>> {
    if tag >= 0x80 || tag & 7 != 2 {
        return Err(PyValueError::new_err("tag: a one-byte tag of a length-delimited field"));
    }
    let mut out = Vec::new();
    attributes(&mut out, tag, attrs, None)?;
    Ok(PyBytes::new(py, &out))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn varints_are_little_endian_groups_of_seven() {
        let mut out = Vec::new();
        put_varint(&mut out, 300);
        assert_eq!(out, [0xac, 0x02]);
        out.clear();
        any_int(&mut out, -1);
        assert_eq!(out, [0x18, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x01]);
    }

    #[test]
    fn a_nested_fields_length_moves_its_payload_when_it_needs_two_bytes() {
        for n in [0usize, 1, 127, 128, 300, 20_000] {
            let mut out = vec![0xee];
            put_nested(&mut out, 0x0a, |out| out.extend(std::iter::repeat_n(7u8, n)));
            let mut head = vec![0xee, 0x0a];
            put_varint(&mut head, n as u64);
            assert_eq!(&out[..head.len()], &head[..], "length {n}");
            assert_eq!(out.len(), head.len() + n);
            assert!(out[head.len()..].iter().all(|&b| b == 7));
        }
    }

    #[test]
    fn a_key_value_holds_its_key_and_any_value() {
        let mut out = Vec::new();
        key_value(&mut out, 0x4a, "k", |out| any_bool(out, true));
        assert_eq!(out, [0x4a, 0x07, 0x0a, 0x01, b'k', 0x12, 0x02, 0x10, 0x01]);
        out.clear();
        any_array(&mut out, |out| put_nested(out, 0x0a, |out| any_double(out, 0.5)));
        let mut want = vec![0x2a, 0x0b, 0x0a, 0x09, 0x21];
        want.extend_from_slice(&0.5f64.to_le_bytes());
        assert_eq!(out, want);
    }
}
