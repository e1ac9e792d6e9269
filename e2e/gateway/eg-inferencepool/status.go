package main

import (
	"context"
	"log"
	"reflect"
	"sort"
	"strconv"
	"strings"
	"time"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/kubernetes"
	"sigs.k8s.io/controller-runtime/pkg/client/config"
)

const controllerName = "gateway.envoyproxy.io/gatewayclass-controller"

var (
	poolsGVR  = schema.GroupVersionResource{Group: "inference.networking.k8s.io", Version: "v1", Resource: "inferencepools"}
	routesGVR = schema.GroupVersionResource{Group: "gateway.networking.k8s.io", Version: "v1", Resource: "httproutes"}
)

type parentKey struct{ Namespace, Name string }

// parentsOf: pool (namespace/name) -> the Gateways that accepted an HTTPRoute naming it as a backend.
func parentsOf(routes []unstructured.Unstructured) map[string]map[parentKey]bool {
	out := map[string]map[parentKey]bool{}
	for _, r := range routes {
		ns := r.GetNamespace()
		accepted := map[parentKey]bool{}
		parents, _, _ := unstructured.NestedSlice(r.Object, "status", "parents")
		for _, p := range parents {
			pm, _ := p.(map[string]any)
			if pm["controllerName"] != controllerName {
				continue
			}
			conds, _ := pm["conditions"].([]any)
			for _, c := range conds {
				cm, _ := c.(map[string]any)
				if cm["type"] == "Accepted" && cm["status"] == "True" {
					ref, _ := pm["parentRef"].(map[string]any)
					pns, _ := ref["namespace"].(string)
					if pns == "" {
						pns = ns
					}
					name, _ := ref["name"].(string)
					accepted[parentKey{pns, name}] = true
				}
			}
		}
		rules, _, _ := unstructured.NestedSlice(r.Object, "spec", "rules")
		for _, rule := range rules {
			rm, _ := rule.(map[string]any)
			refs, _ := rm["backendRefs"].([]any)
			for _, b := range refs {
				bm, _ := b.(map[string]any)
				if bm["group"] != "inference.networking.k8s.io" || bm["kind"] != "InferencePool" {
					continue
				}
				bns, _ := bm["namespace"].(string)
				if bns == "" {
					bns = ns
				}
				name, _ := bm["name"].(string)
				key := bns + "/" + name
				if out[key] == nil {
					out[key] = map[parentKey]bool{}
				}
				for g := range accepted {
					out[key][g] = true
				}
			}
		}
	}
	return out
}

func condition(kind, status, reason, message string, generation int64) map[string]any {
	return map[string]any{
		"type": kind, "status": status, "reason": reason, "message": message,
		"observedGeneration": generation, "lastTransitionTime": time.Now().UTC().Format(time.RFC3339),
	}
}

// poolParents: the pool's status.parents, Gateways in name order.
func poolParents(pool *unstructured.Unstructured, gateways map[parentKey]bool, pickerExists bool) []any {
	keys := make([]parentKey, 0, len(gateways))
	for g := range gateways {
		keys = append(keys, g)
	}
	sort.Slice(keys, func(i, j int) bool {
		return keys[i].Namespace+"/"+keys[i].Name < keys[j].Namespace+"/"+keys[j].Name
	})
	gen := pool.GetGeneration()
	resolved := condition("ResolvedRefs", "True", "ResolvedRefs", "the endpoint picker's Service exists", gen)
	if !pickerExists {
		resolved = condition("ResolvedRefs", "False", "InvalidExtensionRef", "the endpoint picker's Service does not exist", gen)
	}
	out := []any{}
	for _, g := range keys {
		out = append(out, map[string]any{
			"parentRef":      map[string]any{"group": "gateway.networking.k8s.io", "kind": "Gateway", "namespace": g.Namespace, "name": g.Name},
			"controllerName": controllerName,
			"conditions":     []any{condition("Accepted", "True", "Accepted", "the Gateway routes to this pool", gen), resolved},
		})
	}
	return out
}

// ours: the entries of a status.parents list this controller wrote; the others: everyone else's.
func ours(list []any) (mine, others []any) {
	for _, p := range list {
		if pm, ok := p.(map[string]any); ok && pm["controllerName"] == controllerName {
			mine = append(mine, p)
		} else {
			others = append(others, p)
		}
	}
	return mine, others
}

// sameParents compares two status.parents lists, ignoring the conditions' transition times.
func sameParents(a, b []any) bool {
	strip := func(list []any) []any {
		out := []any{}
		for _, p := range list {
			pm := map[string]any{}
			if m, ok := p.(map[string]any); ok {
				for k, v := range m {
					pm[k] = v
				}
			}
			conds := []any{}
			list, _ := pm["conditions"].([]any)
			for _, c := range list {
				cm := map[string]any{}
				if m, ok := c.(map[string]any); ok {
					for k, v := range m {
						if k != "lastTransitionTime" {
							cm[k] = v
						}
					}
				}
				conds = append(conds, cm)
			}
			pm["conditions"] = conds
			out = append(out, pm)
		}
		return out
	}
	return reflect.DeepEqual(normalize(strip(a)), normalize(strip(b)))
}

// normalize round-trips through the generic JSON types, so numbers compare equal however they came.
func normalize(v []any) any {
	u := unstructured.Unstructured{Object: map[string]any{"v": v}}
	out, _ := u.MarshalJSON()
	back := unstructured.Unstructured{}
	_ = back.UnmarshalJSON(out)
	return back.Object["v"]
}

func syncStatus(ctx context.Context, dyn dynamic.Interface, core kubernetes.Interface) error {
	routes, err := dyn.Resource(routesGVR).List(ctx, metav1.ListOptions{})
	if err != nil {
		return err
	}
	pools, err := dyn.Resource(poolsGVR).List(ctx, metav1.ListOptions{})
	if err != nil {
		return err
	}
	parents := parentsOf(routes.Items)
	for i := range pools.Items {
		pool := &pools.Items[i]
		picker, _, _ := unstructured.NestedString(pool.Object, "spec", "endpointPickerRef", "name")
		_, err := core.CoreV1().Services(pool.GetNamespace()).Get(ctx, picker, metav1.GetOptions{})
		exists := err == nil
		if err != nil && !apierrors.IsNotFound(err) {
			return err
		}
		want := poolParents(pool, parents[pool.GetNamespace()+"/"+pool.GetName()], exists)
		have, _, _ := unstructured.NestedSlice(pool.Object, "status", "parents")
		mine, others := ours(have) // another Gateway's entries are its own to write
		if sameParents(mine, want) {
			continue
		}
		if err := unstructured.SetNestedSlice(pool.Object, append(others, want...), "status", "parents"); err != nil {
			return err
		}
		if _, err := dyn.Resource(poolsGVR).Namespace(pool.GetNamespace()).UpdateStatus(ctx, pool, metav1.UpdateOptions{}); err != nil && !apierrors.IsConflict(err) {
			return err
		}
	}
	return nil
}

// statusLoop writes the pools' status every second (a conflict or an error: the next round again).
func statusLoop() {
	cfg, err := config.GetConfig()
	if err != nil {
		log.Fatalf("kubernetes config: %v", err)
	}
	dyn := dynamic.NewForConfigOrDie(cfg)
	core := kubernetes.NewForConfigOrDie(cfg)
	for {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		if err := syncStatus(ctx, dyn, core); err != nil {
			log.Printf("pool status: %v", err)
		}
		cancel()
		time.Sleep(time.Second)
	}
}

// ruleWeights is each of pools' weight in the HTTPRoute rule Envoy Gateway named cluster after
// (httproute/<ns>/<name>/rule/<i>), 1 where the rule does not say (or cannot be read).
func ruleWeights(cluster string, pools []pool) []uint32 {
	out := make([]uint32, len(pools))
	for i := range out {
		out[i] = 1
	}
	parts := strings.Split(cluster, "/")
	if len(parts) != 5 || parts[0] != "httproute" || parts[3] != "rule" {
		return out
	}
	rule, err := strconv.Atoi(parts[4])
	if err != nil {
		return out
	}
	cfg, err := config.GetConfig()
	if err != nil {
		return out
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	route, err := dynamic.NewForConfigOrDie(cfg).Resource(routesGVR).Namespace(parts[1]).Get(ctx, parts[2], metav1.GetOptions{})
	if err != nil {
		log.Printf("weights of %s: %v", cluster, err)
		return out
	}
	rules, _, _ := unstructured.NestedSlice(route.Object, "spec", "rules")
	if rule >= len(rules) {
		return out
	}
	refs, _ := rules[rule].(map[string]any)["backendRefs"].([]any)
	for i, p := range pools {
		for _, b := range refs {
			bm, _ := b.(map[string]any)
			bns, _ := bm["namespace"].(string)
			if bns == "" {
				bns = parts[1]
			}
			if bm["kind"] == "InferencePool" && bm["name"] == p.Name && bns == p.Namespace {
				if w, ok := bm["weight"].(int64); ok && w >= 0 {
					out[i] = uint32(w)
				}
			}
		}
	}
	return out
}
