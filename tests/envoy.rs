//! tollgate as Envoy's rate limit service, end to end over gRPC: a tonic client plays Envoy
//! and calls `ShouldRateLimit` on a real tonic server over loopback.

#[test]
fn envoy_generated_code_is_current() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src/envoy");
    let descriptors = protox::compile([root.join("rls.proto")], [root.clone()])
        .unwrap_or_else(|e| panic!("rls.proto: {e}"));
    let out = std::env::temp_dir().join(format!("tollgate-envoy-{}", std::process::id()));
    std::fs::create_dir_all(&out).unwrap();
    tonic_prost_build::configure()
        .build_transport(false)
        .out_dir(&out)
        .compile_fds(descriptors)
        .unwrap();
    let generated = std::fs::read_to_string(out.join("envoy.service.ratelimit.v3.rs")).unwrap();
    let _ = std::fs::remove_dir_all(&out);
    let committed_path = root.join("envoy.service.ratelimit.v3.rs");
    if std::env::var_os("TOLLGATE_BLESS").is_some() {
        std::fs::write(&committed_path, &generated).unwrap();
    }
    let committed = std::fs::read_to_string(&committed_path).unwrap_or_default();
    assert!(
        committed == generated,
        "src/envoy/envoy.service.ratelimit.v3.rs is not what rls.proto generates: rerun with TOLLGATE_BLESS=1"
    );
}
