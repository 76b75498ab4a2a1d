//! Unit tests of the publication checks.

use walbox_pgoutput::{RelationColumn, ReplicaIdentity};

use super::*;

const STANDARD: &[&str] = &[
    "id",
    "aggregate_type",
    "aggregate_id",
    "event_type",
    "payload",
    "headers",
    "occurred_at",
    "schema_version",
];

fn relation(columns: &[&str]) -> Relation {
    Relation {
        xid: None,
        oid: 16_400,
        namespace: "public".into(),
        name: "outbox".into(),
        replica_identity: ReplicaIdentity::Default,
        columns: columns
            .iter()
            .map(|n| RelationColumn {
                flags: 0,
                name: (*n).into(),
                // jsonb for payload and headers, text for the rest.
                type_oid: if matches!(*n, "payload" | "headers") {
                    3802
                } else {
                    25
                },
                type_modifier: -1,
            })
            .collect(),
    }
}

fn good() -> Facts {
    Facts {
        publication: "walbox_outbox".into(),
        flags: Some(PublicationFlags {
            inserts: true,
            updates: true,
            deletes: true,
            truncates: true,
            via_root: false,
            walbox_made: true,
        }),
        tables: vec![(
            "public.outbox".into(),
            Some(FoundTable {
                relation: relation(STANDARD),
                partitioned: false,
                partition_root: None,
                membership: Some(Membership::default()),
            }),
        )],
    }
}

fn check(facts: &Facts) -> Vec<String> {
    problems(&[TableConfig::new("outbox")], "p", facts)
        .iter()
        .map(ToString::to_string)
        .collect()
}

fn table(facts: &mut Facts) -> &mut FoundTable {
    facts.tables[0].1.as_mut().unwrap()
}

#[test]
fn a_complete_publication_passes() {
    assert!(check(&good()).is_empty());
    // A column list with every mapped column (and without others) passes too.
    let mut f = good();
    table(&mut f).membership = Some(Membership {
        columns: Some(STANDARD.iter().map(|c| (*c).to_owned()).collect()),
        row_filter: None,
    });
    assert!(check(&f).is_empty());
}

#[test]
fn a_missing_publication_or_table_is_named() {
    let mut f = good();
    f.flags = None;
    assert_eq!(check(&f).len(), 1);
    assert!(check(&f)[0].contains("publication walbox_outbox does not exist"));
    let mut f = good();
    f.tables[0].1 = None;
    assert_eq!(check(&f), ["outbox table public.outbox does not exist"]);
}

#[test]
fn a_publication_without_inserts_is_refused_with_the_fix() {
    let mut f = good();
    if let Some(flags) = f.flags.as_mut() {
        flags.inserts = false;
        flags.truncates = false;
    }
    let p = check(&f);
    assert_eq!(p.len(), 1, "{p:?}");
    assert!(
        p[0].contains("does not publish inserts (publish = 'update, delete')"),
        "{}",
        p[0]
    );
    assert!(
        p[0].contains(
            r#"ALTER PUBLICATION "walbox_outbox" SET (publish = 'insert, update, delete')"#
        ),
        "{}",
        p[0]
    );
}

#[test]
fn a_table_not_in_the_publication_is_refused_with_the_fix() {
    let mut f = good();
    table(&mut f).membership = None;
    let p = check(&f);
    assert_eq!(p.len(), 1);
    assert!(p[0].contains("outbox table public.outbox is not in publication walbox_outbox"));
    assert!(p[0].contains(r#"ALTER PUBLICATION "walbox_outbox" ADD TABLE "public"."outbox""#));
}

#[test]
fn a_column_list_without_mapped_columns_is_refused_naming_them() {
    let mut f = good();
    table(&mut f).membership = Some(Membership {
        columns: Some(STANDARD[..5].iter().map(|c| (*c).to_owned()).collect()),
        row_filter: None,
    });
    let p = check(&f);
    assert_eq!(p.len(), 1);
    assert!(
        p[0].contains("without headers, occurred_at, schema_version that the mapping reads"),
        "{}",
        p[0]
    );
    assert!(p[0].contains(r#"DROP TABLE "public"."outbox"; ALTER PUBLICATION "walbox_outbox" ADD TABLE "public"."outbox"; COMMIT"#), "{}", p[0]);
    // Columns the table lacks are not asked for: the mapping does not read them.
    table(&mut f).relation = relation(&STANDARD[..5]);
    assert!(check(&f).is_empty());
}

#[test]
fn a_row_filter_is_refused() {
    let mut f = good();
    table(&mut f).membership = Some(Membership {
        columns: None,
        row_filter: Some("(aggregate_type <> 'audit'::text)".into()),
    });
    let p = check(&f);
    assert_eq!(p.len(), 1);
    assert!(
        p[0].contains(
            "has a row filter on public.outbox (WHERE (aggregate_type <> 'audit'::text))"
        ),
        "{}",
        p[0]
    );
}

#[test]
fn a_partitioned_table_needs_publish_via_partition_root() {
    let mut f = good();
    table(&mut f).partitioned = true;
    // Without it, the root is not listed either: only the partitions are.
    table(&mut f).membership = None;
    let p = check(&f);
    assert_eq!(p.len(), 1);
    assert!(
        p[0].contains("SET (publish_via_partition_root = true)"),
        "{}",
        p[0]
    );
    if let Some(flags) = f.flags.as_mut() {
        flags.via_root = true;
    }
    table(&mut f).membership = Some(Membership::default());
    assert!(check(&f).is_empty());
}

#[test]
fn a_partition_published_as_its_root_is_refused() {
    let mut f = good();
    if let Some(flags) = f.flags.as_mut() {
        flags.via_root = true;
    }
    table(&mut f).partition_root = Some(("public.events".into(), true));
    let p = check(&f);
    assert_eq!(p.len(), 1);
    assert!(p[0].contains("is a partition of public.events"), "{}", p[0]);
    // Its root not being published, its own entry counts.
    table(&mut f).partition_root = Some(("public.events".into(), false));
    assert!(check(&f).is_empty());
}

#[test]
fn every_problem_is_listed() {
    let mut f = good();
    if let Some(flags) = f.flags.as_mut() {
        flags.inserts = false;
    }
    table(&mut f).membership = Some(Membership {
        columns: Some(vec!["id".into()]),
        row_filter: Some("true".into()),
    });
    let p = problems(&[TableConfig::new("outbox")], "p", &f);
    assert_eq!(p.len(), 3, "{p:?}");
    let text = refusal(&p);
    assert_eq!(text.lines().count(), 4, "{text}");
}
