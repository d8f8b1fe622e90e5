//! A wasmi host for the built filter module, to run its test export outside Envoy.
//!
//! The module is the exact artifact Envoy loads (`$KVROUTE_WASM`). Its imports are satisfied
//! generically by walking the module's import list: every function import (the proxy-wasm ABI,
//! WASI if a dependency ever pulls it in) becomes a stub that returns zeros, i.e. `Ok` for
//! proxy-wasm's status codes; `proxy_log` additionally records its message. Memory/table/global
//! imports get a fresh item of the declared type. So a new import never breaks the host, and
//! [`FilterModule::imports`] lets a test assert the module imports nothing Envoy lacks.
//!
//! Calls run with a fuel budget so a runaway loop in the module fails the test instead of hanging it.

use std::path::Path;

use anyhow::{anyhow, bail, Context, Result};
use serde_json::Value;
use wasmi::{
    Caller, Config, Engine, Extern, ExternType, Global, Instance, Linker, Memory, Module, Store,
    Table, TypedFunc, Val,
};

use crate::harness;

/// Fuel for one call: far above what hashing a few thousand blocks needs, far below a hang.
const FUEL_PER_CALL: u64 = 50_000_000_000;

/// What the stubs observed.
#[derive(Debug, Default)]
pub struct HostLog {
    /// `(level, message)` of every `proxy_log` call.
    pub logs: Vec<(i32, String)>,
    /// Every call to a stubbed import, as `module::name`, in call order.
    pub stub_calls: Vec<String>,
}

/// One import of the module.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Import {
    pub module: String,
    pub name: String,
    /// `func`, `memory`, `table` or `global`.
    pub kind: &'static str,
}

/// The built filter, instantiated in wasmi.
pub struct FilterModule {
    store: Store<HostLog>,
    instance: Instance,
    imports: Vec<Import>,
    alloc: TypedFunc<i32, i32>,
    test_keys: TypedFunc<(i32, i32), i64>,
}

impl FilterModule {
    /// Loads the module scripts/build-wasm.sh produced (see [`harness::wasm_module`]).
    pub fn load() -> Result<FilterModule> {
        FilterModule::from_file(&harness::wasm_module()?)
    }

    /// Loads and instantiates a module file, running `_initialize` as Envoy does.
    pub fn from_file(path: &Path) -> Result<FilterModule> {
        let bytes = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
        let mut config = Config::default();
        config.consume_fuel(true);
        let engine = Engine::new(&config);
        let module = Module::new(&engine, &bytes)
            .map_err(|e| anyhow!("{}: not a valid module: {e}", path.display()))?;
        let mut store = Store::new(&engine, HostLog::default());
        let mut linker = Linker::<HostLog>::new(&engine);
        let mut imports = Vec::new();
        for import in module.imports() {
            let (module_name, name) = (import.module().to_string(), import.name().to_string());
            let kind = match import.ty() {
                ExternType::Func(ty) => {
                    let label = format!("{module_name}::{name}");
                    let is_log = module_name == "env" && name == "proxy_log";
                    linker
                        .func_new(
                            &module_name,
                            &name,
                            ty.clone(),
                            move |mut caller, params, results| {
                                if is_log {
                                    record_log(&mut caller, params);
                                }
                                caller.data_mut().stub_calls.push(label.clone());
                                for r in results.iter_mut() {
                                    *r = Val::default(r.ty());
                                }
                                Ok(())
                            },
                        )
                        .map_err(|e| anyhow!("defining {module_name}::{name}: {e}"))?;
                    "func"
                }
                ExternType::Memory(ty) => {
                    let mem = Memory::new(&mut store, *ty)
                        .map_err(|e| anyhow!("memory import {name}: {e}"))?;
                    linker
                        .define(&module_name, &name, mem)
                        .map_err(|e| anyhow!("{e}"))?;
                    "memory"
                }
                ExternType::Table(ty) => {
                    let init = Val::default(ty.element());
                    let table = Table::new(&mut store, *ty, init)
                        .map_err(|e| anyhow!("table import {name}: {e}"))?;
                    linker
                        .define(&module_name, &name, table)
                        .map_err(|e| anyhow!("{e}"))?;
                    "table"
                }
                ExternType::Global(ty) => {
                    let global =
                        Global::new(&mut store, Val::default(ty.content()), ty.mutability());
                    linker
                        .define(&module_name, &name, global)
                        .map_err(|e| anyhow!("{e}"))?;
                    "global"
                }
            };
            imports.push(Import {
                module: module_name,
                name,
                kind,
            });
        }
        let instance = linker
            .instantiate(&mut store, &module)
            .and_then(|pre| pre.start(&mut store))
            .map_err(|e| anyhow!("instantiating {}: {e}", path.display()))?;
        store.set_fuel(FUEL_PER_CALL).map_err(|e| anyhow!("{e}"))?;
        if let Ok(init) = instance.get_typed_func::<(), ()>(&store, "_initialize") {
            init.call(&mut store, ())
                .map_err(|e| anyhow!("_initialize trapped: {e}"))?;
        }
        // The SDK exports its allocator as `malloc` on wasm32-unknown-unknown and as
        // `proxy_on_memory_allocate` elsewhere; Envoy accepts either.
        let alloc = ["proxy_on_memory_allocate", "malloc"]
            .iter()
            .find_map(|n| instance.get_typed_func::<i32, i32>(&store, n).ok())
            .ok_or_else(|| anyhow!("module exports neither proxy_on_memory_allocate nor malloc"))?;
        let test_keys = instance
            .get_typed_func::<(i32, i32), i64>(&store, "kvroute_test_keys")
            .map_err(|e| anyhow!("module has no kvroute_test_keys(i32, i32) -> i64 export: {e}"))?;
        Ok(FilterModule {
            store,
            instance,
            imports,
            alloc,
            test_keys,
        })
    }

    /// Every import the module declares.
    pub fn imports(&self) -> &[Import] {
        &self.imports
    }

    /// Names of the module's exports.
    pub fn exports(&self) -> Vec<String> {
        self.instance
            .exports(&self.store)
            .map(|e| e.name().to_string())
            .collect()
    }

    /// What the stubs recorded so far.
    pub fn host_log(&self) -> &HostLog {
        self.store.data()
    }

    /// Calls `kvroute_test_keys` with `request` and returns its parsed JSON answer
    /// (`{"keys": [...]}` or `{"error": "..."}`).
    pub fn test_keys(&mut self, request: &Value) -> Result<Value> {
        let input = serde_json::to_vec(request)?;
        let out = self.call_json(&input)?;
        serde_json::from_slice(&out).with_context(|| {
            format!(
                "kvroute_test_keys answered non-JSON: {}",
                String::from_utf8_lossy(&out)
            )
        })
    }

    fn memory(&self) -> Result<Memory> {
        self.instance
            .get_memory(&self.store, "memory")
            .ok_or_else(|| anyhow!("module exports no memory"))
    }

    fn call_json(&mut self, input: &[u8]) -> Result<Vec<u8>> {
        self.store
            .set_fuel(FUEL_PER_CALL)
            .map_err(|e| anyhow!("{e}"))?;
        let len = i32::try_from(input.len()).context("request larger than 2 GiB")?;
        let ptr = self
            .alloc
            .call(&mut self.store, len)
            .map_err(|e| anyhow!("allocator trapped: {e}"))?;
        let memory = self.memory()?;
        memory
            .write(&mut self.store, ptr as u32 as usize, input)
            .map_err(|e| anyhow!("writing request at {ptr:#x}: {e}"))?;
        let packed = self
            .test_keys
            .call(&mut self.store, (ptr, len))
            .map_err(|e| anyhow!("kvroute_test_keys trapped: {e}"))? as u64;
        let (out_ptr, out_len) = ((packed >> 32) as usize, (packed & 0xffff_ffff) as usize);
        let data = memory.data(&self.store);
        match data.get(out_ptr..out_ptr.saturating_add(out_len)) {
            Some(out) => Ok(out.to_vec()),
            None => bail!(
                "kvroute_test_keys returned {out_ptr:#x}+{out_len} outside memory ({} bytes)",
                data.len()
            ),
        }
    }
}

/// Copies `proxy_log(level, ptr, len)`'s message out of the caller's memory.
fn record_log(caller: &mut Caller<'_, HostLog>, params: &[Val]) {
    let (Some(Val::I32(level)), Some(Val::I32(ptr)), Some(Val::I32(len))) =
        (params.first(), params.get(1), params.get(2))
    else {
        return;
    };
    let Some(Extern::Memory(mem)) = caller.get_export("memory") else {
        return;
    };
    let (start, len) = (*ptr as u32 as usize, *len as u32 as usize);
    let msg = mem
        .data(&*caller)
        .get(start..start.saturating_add(len))
        .map(|b| String::from_utf8_lossy(b).into_owned())
        .unwrap_or_default();
    caller.data_mut().logs.push((*level, msg));
}
