//! `train.device = "wgpu"`: burn's wgpu runtime pinned to one graphics API, on the adapter of
//! this worker's `local_rank`.

use burn::tensor::wgpu::{wgpu, WgpuBackend};
use burn::tensor::{Device, DeviceKind as Adapter};

use super::{unavailable, DeviceError, DeviceInfo, DeviceKind, Placement};

/// The graphics API lockstep pins: Metal on macOS, Vulkan elsewhere.
#[cfg(target_os = "macos")]
const API: (WgpuBackend, wgpu::Backends, &str) =
    (WgpuBackend::Metal, wgpu::Backends::METAL, "metal");
#[cfg(not(target_os = "macos"))]
const API: (WgpuBackend, wgpu::Backends, &str) =
    (WgpuBackend::Vulkan, wgpu::Backends::VULKAN, "vulkan");

/// The machine's adapters on the pinned API, in enumeration order (the order burn's selectors
/// count in).
fn adapters() -> Vec<wgpu::AdapterInfo> {
    let instance = wgpu::Instance::new(wgpu::InstanceDescriptor {
        backends: API.1,
        ..wgpu::InstanceDescriptor::new_without_display_handle()
    });
    futures_lite::future::block_on(instance.enumerate_adapters(API.1))
        .iter()
        .map(wgpu::Adapter::get_info)
        .collect()
}

/// burn's selector for `adapters[i]`: each device type counts from zero on its own.
fn selector(adapters: &[wgpu::AdapterInfo], i: usize) -> Adapter {
    let ty = adapters[i].device_type;
    let nth = adapters[..i].iter().filter(|a| a.device_type == ty).count();
    match ty {
        wgpu::DeviceType::DiscreteGpu => Adapter::DiscreteGpu(nth),
        wgpu::DeviceType::IntegratedGpu => Adapter::IntegratedGpu(nth),
        wgpu::DeviceType::VirtualGpu => Adapter::VirtualGpu(nth),
        wgpu::DeviceType::Cpu => Adapter::Cpu,
        wgpu::DeviceType::Other => Adapter::DefaultDevice,
    }
}

/// The setting a refusal names: `auto` looks for hardware adapters only.
fn asked(hardware_only: bool) -> DeviceKind {
    if hardware_only {
        DeviceKind::Auto
    } else {
        DeviceKind::Wgpu
    }
}

/// The machine's adapters and the one of `local_rank`: hardware adapters first, software ones
/// (llvmpipe) after them, or none with `hardware_only` (what `auto` asks).
pub(super) fn find(
    local_rank: usize,
    hardware_only: bool,
) -> Result<(Vec<wgpu::AdapterInfo>, usize), DeviceError> {
    let asked = asked(hardware_only);
    let all = adapters();
    let software = |a: &wgpu::AdapterInfo| a.device_type == wgpu::DeviceType::Cpu;
    let mut order: Vec<usize> = (0..all.len()).filter(|&i| !software(&all[i])).collect();
    if !hardware_only {
        order.extend((0..all.len()).filter(|&i| software(&all[i])));
    }
    if order.is_empty() {
        return Err(unavailable(
            asked,
            format!(
                "no {} adapter on this machine{} (wgpu is not allowed to fall back to another \
                 graphics API; on Debian, `apt-get install mesa-vulkan-drivers` gives the \
                 software adapter llvmpipe)",
                API.2,
                if hardware_only && !all.is_empty() {
                    " but a software one"
                } else {
                    ""
                }
            ),
        ));
    }
    Ok((all, order[local_rank % order.len()]))
}

/// Open the adapter of `local_rank` (see [`find`]).
pub(super) fn open(local_rank: usize, hardware_only: bool) -> Result<Placement, DeviceError> {
    let asked = asked(hardware_only);
    let (all, index) = find(local_rank, hardware_only)?;
    let info = &all[index];
    let device = Device::wgpu_options()
        .device_kind(selector(&all, index))
        .graphics_api(API.0)
        .init()
        .map_err(|e| unavailable(asked, format!("opening {} ({}): {e}", info.name, API.2)))?;
    Ok(Placement {
        device,
        info: DeviceInfo {
            kind: DeviceKind::Wgpu,
            backend: format!("wgpu/{}", API.2),
            adapter: format!(
                "{} ({:?}, {})",
                info.name, info.device_type, info.driver_info
            )
            .replace(" ()", ""),
            index,
        },
    })
}
