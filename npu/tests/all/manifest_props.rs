//! Property test: a graph-set manifest with any value replaced by any other (or its text cut or corrupted) is read
//! or refused with an error, never a panic.

use proptest::prelude::*;
use serde_json::Value;
use std::path::Path;

fn manifest() -> (String, std::path::PathBuf) {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../testdata/sets/tiny-decoder");
    (
        std::fs::read_to_string(dir.join("manifest.json")).unwrap(),
        dir,
    )
}

/// Every path to a value in `v` (object keys and array indices).
fn paths(v: &Value, at: Vec<String>, out: &mut Vec<Vec<String>>) {
    out.push(at.clone());
    match v {
        Value::Object(m) => {
            for (k, x) in m {
                let mut p = at.clone();
                p.push(k.clone());
                paths(x, p, out);
            }
        }
        Value::Array(a) => {
            for (i, x) in a.iter().enumerate() {
                let mut p = at.clone();
                p.push(i.to_string());
                paths(x, p, out);
            }
        }
        _ => {}
    }
}

fn at_mut<'a>(v: &'a mut Value, path: &[String]) -> &'a mut Value {
    path.iter().fold(v, |v, k| match v {
        Value::Object(m) => m.get_mut(k).unwrap(),
        Value::Array(a) => &mut a[k.parse::<usize>().unwrap()],
        _ => unreachable!(),
    })
}

fn replacement() -> impl Strategy<Value = Value> {
    prop_oneof![
        Just(Value::Null),
        Just(serde_json::json!(-1)),
        Just(serde_json::json!(0)),
        Just(serde_json::json!(1e300)),
        Just(serde_json::json!(18446744073709551615u64)),
        Just(serde_json::json!("")),
        Just(serde_json::json!("../../../etc/passwd")),
        Just(serde_json::json!("{i}{j}")),
        Just(serde_json::json!(true)),
        Just(serde_json::json!([])),
        Just(serde_json::json!({})),
        Just(serde_json::json!(["tokens", "context+tokens", 7])),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn any_value_replaced_is_read_or_refused(pick in any::<prop::sample::Index>(), by in replacement(), drop in any::<bool>()) {
        let (text, dir) = manifest();
        let mut v: Value = serde_json::from_str(&text).unwrap();
        let mut all = Vec::new();
        paths(&v, vec![], &mut all);
        let path = pick.get(&all).clone();
        if drop && !path.is_empty() {
            let (last, parent) = path.split_last().unwrap();
            match at_mut(&mut v, parent) {
                Value::Object(m) => { m.remove(last); }
                Value::Array(a) => { a.remove(last.parse::<usize>().unwrap()); }
                _ => {}
            }
        } else {
            *at_mut(&mut v, &path) = by;
        }
        let _ = npu::graphset::manifest::parse(&v.to_string(), &dir, "manifest.json");
    }

    #[test]
    fn cut_or_corrupted_text_is_refused_not_a_panic(cut in any::<prop::sample::Index>(), byte in any::<u8>(), at in any::<prop::sample::Index>()) {
        let (text, dir) = manifest();
        let mut bytes = text.into_bytes();
        let i = at.index(bytes.len());
        bytes[i] = byte;
        bytes.truncate(cut.index(bytes.len() + 1));
        let text = String::from_utf8_lossy(&bytes);
        let _ = npu::graphset::manifest::parse(&text, &dir, "manifest.json");
    }
}
