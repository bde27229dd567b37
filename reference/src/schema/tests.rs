use super::*;
use crate::vision::config::VisionConfig;

/// Each integer key of `json` (at `path`, `None`: the top level) doubled, one at a time: the key, the edited JSON.
fn doubled(json: &serde_json::Value, path: Option<&str>) -> Vec<(String, String)> {
    let object = path.map_or(json, |p| &json[p]);
    let mut out = Vec::new();
    for (key, value) in object.as_object().unwrap() {
        let Some(n) = value.as_u64().filter(|&n| n > 0) else {
            continue;
        };
        let mut edited = json.clone();
        let target = match path {
            Some(p) => &mut edited[p][key],
            None => &mut edited[key],
        };
        *target = serde_json::json!(n * 2);
        out.push((key.clone(), edited.to_string()));
    }
    out
}

/// Every dimension a config key changes names that key among the keys it comes from, for every integer key of
/// the dense, the MoE and the vision configs (so an error over a disagreeing shape points to the right key).
#[test]
fn every_dimension_a_config_key_moves_names_that_key() {
    let mut checked = 0;
    for model in ["tiny", "tiny-moe"] {
        let text = std::fs::read_to_string(format!(
            "{}/../testdata/models/{model}/config.json",
            env!("CARGO_MANIFEST_DIR")
        ))
        .unwrap();
        let base = Config::from_json_str(&text, model).unwrap();
        let json: serde_json::Value = serde_json::from_str(&text).unwrap();
        let before = Schema::new(&base).tensors();
        for spec in &before {
            assert_eq!(
                spec.param.shape_keys().len(),
                spec.shape.len(),
                "{}",
                spec.name
            );
        }
        for (key, edited) in doubled(&json, None) {
            let Ok(config) = Config::from_json_str(&edited, model) else {
                continue;
            };
            let after = Schema::new(&config).tensors();
            let after: std::collections::HashMap<&str, &TensorSpec> =
                after.iter().map(|t| (t.name.as_str(), t)).collect();
            for (a, b) in before
                .iter()
                .filter_map(|a| Some((a, *after.get(a.name.as_str())?)))
            {
                for (i, (x, y)) in a.shape.iter().zip(&b.shape).enumerate() {
                    if x != y {
                        let from = a.param.shape_keys()[i];
                        assert!(
                            from.contains(key.as_str()),
                            "{model}: {key} moves dimension {i} of {}, said to come from {from}",
                            a.name
                        );
                        checked += 1;
                    }
                }
            }
        }
    }
    let text = std::fs::read_to_string(format!(
        "{}/../testdata/models/tiny-vl/config.json",
        env!("CARGO_MANIFEST_DIR")
    ))
    .unwrap();
    let json: serde_json::Value = serde_json::from_str(&text).unwrap();
    let base = VisionConfig::from_json_str(&text, "tiny-vl")
        .unwrap()
        .unwrap();
    let before = crate::schema::vision::VisionSchema::new(&base).tensors();
    for t in &before {
        assert_eq!(t.keys().len(), t.shape.len(), "{}", t.name);
    }
    for (key, edited) in doubled(&json, Some("vision_config")) {
        let Ok(Some(config)) = VisionConfig::from_json_str(&edited, "tiny-vl") else {
            continue;
        };
        let after = crate::schema::vision::VisionSchema::new(&config).tensors();
        let after: std::collections::HashMap<&str, _> =
            after.iter().map(|t| (t.name.as_str(), t)).collect();
        for (a, b) in before
            .iter()
            .filter_map(|a| Some((a, *after.get(a.name.as_str())?)))
        {
            for (i, (x, y)) in a.shape.iter().zip(&b.shape).enumerate() {
                if x != y {
                    let from = a.keys()[i];
                    assert!(
                        from.contains(key.as_str()),
                        "vision: {key} moves dimension {i} of {}, said to come from {from}",
                        a.name
                    );
                    checked += 1;
                }
            }
        }
    }
    assert!(checked > 100, "only {checked} dimensions moved");
}
