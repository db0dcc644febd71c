//! Per-parameter gradients handed out during backward, for communication/compute overlap.
//!
//! burn 0.22 has no backward hooks, so each parameter passes through an identity custom op
//! (`grad_tap`, a backend extension) whose hand-written backward copies the incoming gradient
//! (which is the parameter's complete gradient: every parameter is used exactly once) and sends
//! it with its canonical index into a channel.
//!
//! Why the op has a second, ignored input (`anchor`, the input of the layer using the
//! parameter): burn's autodiff runs backward steps grouped by node depth (`order` = 1 + the
//! deepest input), deepest first. An identity op on a parameter leaf alone has depth 1, so
//! every tap would run only at the very end of backward and nothing would overlap. Anchoring
//! the tap on the layer's input gives it depth `order(input) + 1`: it runs right after the
//! backward of the layer that consumes it and before the layers below. Its backward sends no
//! gradient to the anchor, so the anchor's gradient is unchanged.
//!
//! The channel is drained by a scoped thread that calls the caller's callback, so the callback
//! (e.g. starting an all-reduce) runs concurrently with the rest of backward and may borrow from
//! the caller. Delivery ends with an explicit `Done` message sent by a drop guard, so an early
//! return or panic never leaves the draining thread waiting.

use crate::net::ParamTap;
use burn::backend::autodiff::{
    checkpoint::{base::Checkpointer, strategy::CheckpointStrategy},
    grads::Gradients,
    ops::{Backward, Ops, OpsKind},
    Autodiff,
};
use burn::backend::{backend_extension, tensor::FloatTensor, Backend, Dispatch, Flex};
use burn::tensor::Tensor;
use std::sync::mpsc::Sender;

/// What the taps send to the draining thread.
pub(crate) enum Msg {
    /// Gradient of the parameter with this canonical index.
    Grad(usize, Vec<f32>),
    /// Backward finished (or was abandoned): stop draining.
    Done,
}

/// Where a tap's backward delivers its gradient.
#[derive(Clone, Debug)]
pub struct GradSink {
    index: usize,
    tx: Sender<Msg>,
}

#[backend_extension(Flex, Autodiff)]
pub trait GradTap: Backend {
    /// Identity on `param`; backward reports the gradient to `sink`. `anchor` only orders the
    /// op in the backward schedule.
    fn grad_tap(
        param: FloatTensor<Self>,
        anchor: FloatTensor<Self>,
        sink: GradSink,
    ) -> FloatTensor<Self>;
}

impl GradTap for Flex {
    fn grad_tap(
        param: FloatTensor<Self>,
        _anchor: FloatTensor<Self>,
        _sink: GradSink,
    ) -> FloatTensor<Self> {
        param
    }
}

#[derive(Debug)]
struct TapBackward {
    sink: GradSink,
}

impl Backward<Flex, 2> for TapBackward {
    type State = ();

    fn backward(self, ops: Ops<(), 2>, grads: &mut Gradients, _checkpointer: &mut Checkpointer) {
        let grad = grads.consume::<Flex>(&ops.node);
        let values = grad
            .into_data()
            .try_into_vec::<f32>()
            .expect("lockstep-model gradients are f32 by construction");
        // The receiver only disappears if the caller's scope is unwinding; nothing to do then.
        let _ = self.sink.tx.send(Msg::Grad(self.sink.index, values));
        // Neither the parameter leaf nor the anchor gets a gradient from here: the parameter's
        // gradient was just delivered, and the anchor's output does not depend on it.
    }
}

impl<C: CheckpointStrategy> GradTap for Autodiff<Flex, C> {
    fn grad_tap(
        param: FloatTensor<Self>,
        anchor: FloatTensor<Self>,
        sink: GradSink,
    ) -> FloatTensor<Self> {
        let tap = TapBackward { sink };
        match tap
            .prepare::<C>([param.node(), anchor.node()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => prep.finish((), param.into_primitive()),
            OpsKind::UnTracked(prep) => prep.finish(param.into_primitive()),
        }
    }
}

/// Wraps every parameter in a `grad_tap` sending to `tx`.
pub(crate) struct StreamTap {
    pub(crate) tx: Sender<Msg>,
}

impl ParamTap for StreamTap {
    fn tap<const D: usize, const A: usize>(
        &self,
        index: usize,
        param: Tensor<D>,
        anchor: &Tensor<A>,
    ) -> Tensor<D> {
        let sink = GradSink {
            index,
            tx: self.tx.clone(),
        };
        Tensor::from_dispatch(<Dispatch as GradTap>::grad_tap(
            param.into_dispatch(),
            anchor.clone().into_dispatch(),
            sink,
        ))
    }
}

/// Sends `Done` when dropped, whatever path leaves the producing scope.
pub(crate) struct DoneOnDrop(pub(crate) Sender<Msg>);

impl Drop for DoneOnDrop {
    fn drop(&mut self) {
        let _ = self.0.send(Msg::Done);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::net::ParamTap;
    use crate::{Model, ModelSpec};
    use std::sync::mpsc::channel;

    /// Probe messages carry this plus the index of the parameter they ride along with.
    const PROBE: usize = 1000;

    /// The real taps plus, on every parameter, a probe: a zero side branch `grad_tap(Z, anchor)`
    /// added to the parameter (its gradient is unchanged: an addition passes the same gradient
    /// to both terms). The probe of layer k's parameters is anchored on layer k's input, so it
    /// fires only after everything above that input in the graph, layer k's own backward
    /// included: "probe k arrived" means "layer k's backward has run". With `anchored = false`
    /// the real taps are anchored on a leaf of their own instead, which is what taps without the
    /// depth anchor were: the control that must show the late delivery.
    struct ProbeTap {
        real: StreamTap,
        anchored: bool,
    }

    impl ParamTap for ProbeTap {
        fn tap<const D: usize, const A: usize>(
            &self,
            index: usize,
            param: Tensor<D>,
            anchor: &Tensor<A>,
        ) -> Tensor<D> {
            let probe = self
                .real
                .tap(PROBE + index, param.zeros_like().require_grad(), anchor);
            let tapped = if self.anchored {
                self.real.tap(index, param, anchor)
            } else {
                let leaf = param.zeros_like().require_grad();
                self.real.tap(index, param, &leaf)
            };
            tapped + probe
        }
    }

    /// Indices in the order the backward pass sent them (one thread, so exactly its order).
    fn delivery_order(anchored: bool) -> Vec<usize> {
        let spec = ModelSpec::Mlp {
            input: 8,
            hidden: vec![6, 5],
            classes: 3,
        };
        let m = Model::new(&spec, 1).unwrap();
        let n = 4;
        let x: Vec<f32> = (0..n * 8).map(|i| (i as f32 * 0.37).sin()).collect();
        let y = [0u8, 1, 2, 1];
        let (tx, rx) = channel();
        let tap = ProbeTap {
            real: StreamTap { tx },
            anchored,
        };
        let loss = m.scaled_loss(&x, &y, n, 1.0, &tap).unwrap();
        let _grads = loss.backward();
        drop(tap);
        rx.try_iter()
            .filter_map(|msg| match msg {
                Msg::Grad(index, _) => Some(index),
                Msg::Done => None,
            })
            .collect()
    }

    /// The point of streaming: the output layer's gradient is out while the layers below are
    /// still in backward. Layers 0, 1, 2 hold parameters (2k, 2k + 1); the output layer's weight
    /// (index 4) must be delivered before layer 1's backward has run (its probe, PROBE + 2). The
    /// control without the depth anchor delivers it after, so the test can fail. Deterministic:
    /// it checks the order of backward's steps, not how long they took.
    #[test]
    fn output_gradient_is_delivered_before_the_layers_below_run_backward() {
        let pos = |order: &[usize], i: usize| {
            order
                .iter()
                .position(|&x| x == i)
                .unwrap_or_else(|| panic!("{i} never delivered: {order:?}"))
        };
        let order = delivery_order(true);
        assert_eq!(order.len(), 12, "6 parameters and 6 probes: {order:?}");
        assert!(
            pos(&order, 4) < pos(&order, PROBE + 2),
            "with the anchor: {order:?}"
        );
        // The same holds one layer down: layer 1's weight before layer 0's backward.
        assert!(
            pos(&order, 2) < pos(&order, PROBE),
            "with the anchor: {order:?}"
        );
        let control = delivery_order(false);
        assert!(
            pos(&control, 4) > pos(&control, PROBE + 2),
            "the control (no anchor) should deliver late: {control:?}"
        );
    }
}
